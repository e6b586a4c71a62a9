"""The disk tier's budget against the free space of its volume.

A default budget (32 GiB per backend) knows nothing of the drive: on a 64 GB disk two
backends' tiers filled it. So `kvroute serve` gives the backends whose folders share
a volume at most FREE_SHARE of its free space between them, counting what their
folders already hold as free (a restarted tier re-indexes its files; they are its
own to keep). A budget set in the configuration is the user's word and is kept; the
backend says at start what its tier has and the space left (`describe`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .sizes import format_bytes

FREE_SHARE = 0.5  # of a volume's free space, for all the disk tiers on it together


def existing(path: str | Path) -> Path:
    """`path`, or its nearest ancestor that exists (a tier's folder may not yet)."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def folder_bytes(path: str | Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(Path(path).expanduser()):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


def free_bytes(path: str | Path) -> int:
    return shutil.disk_usage(existing(path)).free


@dataclass(frozen=True)
class Tier:
    """One backend's disk tier as `kvroute serve` plans it."""

    folder: str
    budget: int  # as configured
    explicit: bool = False  # set by the user: kept whatever the free space


@dataclass(frozen=True)
class Bounded:
    budget: int  # what the tier gets
    free: int  # the volume's free space now
    sharing: int  # tiers on that volume
    bounded: bool  # the budget is below what was configured, for want of space


def bound(tiers: list[Tier]) -> list[Bounded]:
    """Each tier's budget: the configured one, but a default one at most its share of
    FREE_SHARE of its volume's free space (plus what the tiers there already hold),
    split evenly among the tiers on that volume."""
    volumes = [os.stat(existing(t.folder)).st_dev for t in tiers]
    room: dict[int, int] = {}
    count: dict[int, int] = {}
    for tier, dev in zip(tiers, volumes):
        if dev not in room:
            room[dev] = free_bytes(tier.folder)
        room[dev] += folder_bytes(tier.folder)
        count[dev] = count.get(dev, 0) + 1
    out = []
    for tier, dev in zip(tiers, volumes):
        share = int(room[dev] * FREE_SHARE) // count[dev]
        budget = tier.budget if tier.explicit else min(tier.budget, share)
        out.append(Bounded(budget, free_bytes(tier.folder), count[dev], budget < tier.budget))
    return out


def describe(folder: str | Path, budget: int, held: int) -> tuple[str, bool]:
    """The start-up line of a tier: its budget, folder and the volume's free space;
    and whether the budget is more than the drive can give (free space plus what the
    tier already holds)."""
    free = free_bytes(folder)
    line = (f"disk tier: {format_bytes(budget)} on {Path(folder).expanduser()} "
            f"(free {format_bytes(free)}, held {format_bytes(held)})")
    return line, budget > free + held
