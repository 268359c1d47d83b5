"""Scheduling: when each sandbox is in a tool call or waits for its LLM, and what to do then.

``phases`` tracks each sandbox's phase, ``policy`` names what each policy does, ``scheduler``
acts on them through ``actions.SchedActions`` (implemented by the daemon; this package never
imports it), ``agent_channel`` reads the in-guest phase reporter (guest-agent/) safely and
``agentlink`` connects to every sandbox's channel.
"""
