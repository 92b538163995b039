"""The processes below a process, found by /proc's parent links (stdlib only): tests/conftest.py and the stress
scripts in tests/workers use it to kill a whole tree, torchrun's ranks included, which start sessions of their
own that a signal to torchrun's process group misses."""

import os


def descendants(pid: int) -> list[int]:
    """Every live process below pid."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
