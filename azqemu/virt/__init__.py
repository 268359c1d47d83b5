"""The virt layer: the only part of azqemu that imports libvirt.

``host.Host`` owns the connection and translates libvirt's errors into ours in one place;
``domxml`` writes the domain XML of templates and clones; ``identity`` keeps the checklist of
what every clone must change; ``qmp`` speaks QMP to a domain's own monitor socket; ``agent``
drives the QEMU guest agent.
"""
