"""Simulated sensors, devices and fleets: real validation samples as MQTT sensor messages.

Nothing is imported here; the modules:

    data       what the sensors replay: a prepared reference model's validation.npz, or any .npz
    sensors    one sensor of one device: seeded, message ``seq`` a pure function of (samples, device, seed, seq)
    publisher  a device or a fleet publishing to a broker at a rate, bounded by count and time
    cli        ``edgeline sim``
"""
