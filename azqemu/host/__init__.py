"""The host below the VMs, libvirt aside: procfs readers, page-out and reclaim, the Linux
memory settings (zram, KSM, swap), thread priority, the KVM probe, doctor and host set-up."""
