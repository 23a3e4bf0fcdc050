"""A TrainingGroup too large for one Kafka record travels as parts; readers that need it whole join them.

Kafka bounds a record (polar.groups: 64 MiB), and a group holds every sample's token ids and logprobs:
eight per_request trajectories of a 48-turn session are already past it. Such a group used to be dropped.
Now the streams send it as ``parts`` records that split its trajectories (in sample order), each a valid
TrainingGroup: the trainer trains each part as it comes (advantages are per trajectory, computed over
the whole group first), and a reader that shows whole groups (the viewer, the demo) joins them with
``GroupParts``. A part's event id derives from the whole group's, so a re-send is byte-identical.
"""

from __future__ import annotations

from .codec import encode
from .records import TrainingGroup, derived_event_id

# Bytes a trajectory adds to a part beyond its own encoding: its advantage (a float, at most 24
# characters as JSON) and two commas.
_PER_MEMBER = 32


class GroupTooLarge(ValueError):
    """One trajectory of the group does not fit in a record of the limit, even alone."""


def split_group(group: TrainingGroup, max_bytes: int) -> list[tuple[TrainingGroup, bytes]]:
    """``group`` as records of at most ``max_bytes`` each, with their bytes: the group itself when it
    fits, else its parts. Raises GroupTooLarge when one trajectory cannot fit in any part."""
    data = encode(group)
    if len(data) <= max_bytes:
        return [(group, data)]
    sizes = [len(encode(t)) + _PER_MEMBER for t in group.trajectories]
    # The most a part's own fields take: the group's, with the largest part numbers and an event id.
    shell = len(encode(group.model_copy(update={"trajectories": [], "advantages": [], "part": len(sizes),
                                                "parts": len(sizes) + 1, "part_of": group.event_id})))
    batches: list[list[int]] = [[]]
    used = shell
    for i, size in enumerate(sizes):
        if shell + size > max_bytes:
            raise GroupTooLarge(f"group {group.group_id}: trajectory {group.trajectories[i].event_id} alone is "
                                f"{size} bytes, over the record limit of {max_bytes}")
        if batches[-1] and used + size > max_bytes:
            batches.append([])
            used = shell
        batches[-1].append(i)
        used += size
    n = len(batches)
    out = []
    for k, idx in enumerate(batches):
        part = group.model_copy(update={
            "event_id": derived_event_id("part", group.event_id, k, n),
            "trajectories": [group.trajectories[i] for i in idx],
            "advantages": [group.advantages[i] for i in idx],
            "masked": group.masked if k == 0 else [],
            "part": k, "parts": n, "part_of": group.event_id,
        })
        out.append((part, encode(part)))
    return out


def join_parts(parts: list[TrainingGroup]) -> TrainingGroup:
    """The whole group from all of its parts (any order): what ``split_group`` was given."""
    ordered = sorted(parts, key=lambda p: p.part)
    first = ordered[0]
    if [p.part for p in ordered] != list(range(first.parts)) or any(p.part_of != first.part_of for p in ordered):
        raise ValueError(f"group {first.group_id}: parts {[p.part for p in ordered]} of {first.parts} do not make one group")
    return first.model_copy(update={
        "event_id": first.part_of,
        "trajectories": [t for p in ordered for t in p.trajectories],
        "advantages": [a for p in ordered for a in p.advantages],
        "part": 0, "parts": 1, "part_of": "",
    })


class GroupParts:
    """Joins groups that arrive in parts: ``add`` returns a whole group (at once for an unsplit one,
    with its last part for a split one) or None while parts are still missing."""

    def __init__(self) -> None:
        self._held: dict[str, dict[int, TrainingGroup]] = {}  # whole group's event id -> part -> record

    def add(self, group: TrainingGroup) -> TrainingGroup | None:
        if group.parts == 1:
            return group
        held = self._held.setdefault(group.part_of, {})
        held[group.part] = group
        if len(held) < group.parts:
            return None
        del self._held[group.part_of]
        return join_parts(list(held.values()))
