"""Scheduling: when each sandbox is in a tool call or waits for its LLM, and what to do then.

``agent_channel`` reads the in-guest phase reporter (guest-agent/) safely.
"""
