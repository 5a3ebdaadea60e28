"""How many bytes the CPU's memory-bandwidth read spans: more than every last-level cache of the
machine (so the read goes to memory, not to a cache), within what memory is free now."""

from __future__ import annotations

from pathlib import Path

MIN_READ_BYTES = 256 << 20  # the read buffer's floor, whatever the cache sizes say
LLC_FACTOR = 4  # the read buffer spans this many times every last-level cache of the machine
MAX_CPU_READ_BYTES = 4 << 30
CPU_SYS = Path("/sys/devices/system/cpu")


def llc_bytes(sys_cpu: Path = CPU_SYS) -> int:
    """All last-level cache of the machine: the highest cache level's size times how many
    separate instances of it the CPUs share (an EPYC has one L3 per core complex). 0 unknown."""
    instances: dict[str, int] = {}
    best_level = 0
    for index in sys_cpu.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int((index / "level").read_text())
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = _size_bytes((index / "size").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if level > best_level:
            best_level, instances = level, {}
        if level == best_level:
            instances[shared] = size
    return sum(instances.values())


def _size_bytes(text: str) -> int:
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def cpu_read_bytes() -> int:
    """The CPU read buffer: ``LLC_FACTOR`` times all last-level cache, at least 256 MiB, at most
    4 GiB and a quarter of the memory available now (a worker measures beside its neighbours)."""
    want = max(MIN_READ_BYTES, LLC_FACTOR * llc_bytes())
    avail = _mem_available()
    cap = min(MAX_CPU_READ_BYTES, avail // 4) if avail else MAX_CPU_READ_BYTES
    return max(min(want, cap), 64 << 20)


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
