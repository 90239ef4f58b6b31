"""Processes below a pid, read from /proc: what a `pdserve serve` started, and whether any
outlived it (keyed by pid and start time, so a reused pid never counts as the same process)."""

from __future__ import annotations

from pathlib import Path


def stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, state) of a live process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    state, ppid, start = fields[0], int(fields[1]), int(fields[19])
    return None if state in ("Z", "X") else (ppid, start, state)


def descendants(root: int) -> dict[tuple[int, int], str]:
    """Every live process below `root` now, keyed (pid, start time) so a reused pid never
    counts as the same process; the value is its command line."""
    parents: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := stat(int(entry.name))) is not None:
            parents.setdefault(st[0], []).append((int(entry.name), st[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in parents.get(todo.pop(), []):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            found[(pid, start)] = cmd
            todo.append(pid)
    return found


def alive(processes) -> list[str]:
    return [cmd for (pid, start), cmd in processes.items() if (s := stat(pid)) is not None and s[1] == start]
