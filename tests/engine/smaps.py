"""One mapping's line from /proc/self/smaps (Linux), for tests that check what the kernel holds."""

from __future__ import annotations


def mapping_field(address: int, field: str) -> str:
    """The value of `field` ("Rss", "VmFlags", ...) for the mapping holding `address`, as
    /proc/self/smaps writes it ("4096 kB", "rd mr mw me nh")."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == f"{field}:":
                return line.split(":", 1)[1].strip()
    raise AssertionError(f"no mapping holds {address:#x}, or it has no {field}")
