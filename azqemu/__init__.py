"""azqemu: memory compression for AI-agent sandbox VMs on QEMU/KVM.

Sandboxes are cloned from one template under libvirt; while an agent waits for its LLM,
azqemu encodes the sandbox's guest RAM relative to the template and to sibling sandboxes,
and brings it back (hot pages first, the rest on first touch through userfaultfd).
"""

__version__ = "0.1.0"
