"""Simulated sensors, devices and fleets: real validation samples as MQTT sensor messages, or from emulated
microcontroller boards on a serial link.

Nothing is imported here; the modules:

    data       what the sensors replay: a prepared reference model's validation.npz, or any .npz
    sensors    one sensor of one device: seeded, message ``seq`` a pure function of (samples, device, seed, seq)
    publisher  a device or a fleet publishing to a broker at a rate, bounded by count and time
    board      an emulated sensor board speaking the firmware bridge's protocol, in Python (``PythonBoard``)
    mcu        the same board as C firmware on QEMU's Cortex-M4 (``EmulatedBoard``), built on first use
    source     the daemon's ``sim`` source (``edgeline run --sim``)
    fleet      N ``edgeline run`` daemons with their own state directories, fed and observed (``SimFleet``)
    cli        ``edgeline sim``, ``edgeline sim mcu``, ``edgeline sim fleet``
    vm         a whole machine: Debian 12 booted with QEMU, the daemon under its systemd unit (``scripts/vm.sh``)
    vm_image   the disk image it boots, built from Debian's packages and cached (``scripts/vm.sh build``)
    writelog   a block write log (dm-log-writes format, QEMU's ``blklogwrites``): read, and replayed onto an image
    powercut   power cuts planned from a seed (a flush, a cache that kept some writes, some torn) and replayed
    imagecheck an ext4 image after a cut, checked offline: journal, e2fsck, the outbox, ``state.json``, the bundle
    powercut_vm ``scripts/vm.sh power-cut``: a recording in the VM, its cuts checked and some booted
    mqtt_tap   a loopback proxy in front of a broker that stamps every QoS 1 acknowledgement through it
"""
