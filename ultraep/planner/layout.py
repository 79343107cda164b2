"""The logical/physical expert slot layout: fixed masters, redundant slots, domains.

Rank ``r`` owns ``M = E // R`` master experts ``r*M .. r*M+M-1`` in its physical slots
``0 .. M-1`` and ``S`` redundant slots ``M .. M+S-1`` that the planner fills with
replicas. Physical slot ids are global: ``rank * (M + S) + j``. Replicas stay inside the
master's NVLink domain of ``D`` consecutive ranks.

``max_instances`` (``K``) bounds the instances of one expert (master included). At most
one instance fits on a rank of the domain, so ``K <= D``; the default ``min(D, 16)``
keeps the per-source split table ``[R, E, K]`` small for large layouts (R=72, E=576)
while leaving far more replicas per expert than S=2 slots per rank ever need for
top-k routing skew.
"""

from __future__ import annotations

import operator

DEFAULT_MAX_INSTANCES = 16


def _count(name: str, value, minimum: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


class ExpertLayout:
    """Immutable, hashable layout ``(R, E, S, D, K)``; see the module docstring."""

    __slots__ = ("num_ranks", "num_experts", "redundant_slots", "domain_size", "max_instances")

    def __init__(self, num_ranks: int, num_experts: int, redundant_slots: int, domain_size: int | None = None,
                 max_instances: int | None = None):
        num_ranks = _count("num_ranks", num_ranks, 1)
        num_experts = _count("num_experts", num_experts, 1)
        redundant_slots = _count("redundant_slots", redundant_slots, 0)
        domain_size = num_ranks if domain_size is None else _count("domain_size", domain_size, 1)
        if num_experts % num_ranks:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})")
        if num_ranks % domain_size:
            raise ValueError(f"domain_size ({domain_size}) must divide num_ranks ({num_ranks})")
        if max_instances is None:
            max_instances = min(domain_size, DEFAULT_MAX_INSTANCES)
        max_instances = _count("max_instances", max_instances, 1)
        if max_instances > domain_size:
            raise ValueError(
                f"max_instances ({max_instances}) cannot exceed domain_size ({domain_size}): "
                "at most one instance of an expert per rank of its domain"
            )
        for name, value in (("num_ranks", num_ranks), ("num_experts", num_experts),
                            ("redundant_slots", redundant_slots)):
            if value >= 2**31 - 1:
                raise ValueError(f"{name} ({value}) must fit in int32")
        if num_ranks * (num_experts // num_ranks + redundant_slots) >= 2**31:
            raise ValueError("the number of physical slots must fit in int32")
        for name, value in (("num_ranks", num_ranks), ("num_experts", num_experts),
                            ("redundant_slots", redundant_slots), ("domain_size", domain_size),
                            ("max_instances", max_instances)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError("ExpertLayout is immutable")

    def _key(self):
        return (self.num_ranks, self.num_experts, self.redundant_slots, self.domain_size, self.max_instances)

    def __eq__(self, other):
        return isinstance(other, ExpertLayout) and self._key() == other._key()

    def __hash__(self):
        return hash(("ExpertLayout",) + self._key())

    def __repr__(self):
        return ("ExpertLayout(num_ranks={}, num_experts={}, redundant_slots={}, domain_size={}, "
                "max_instances={})".format(*self._key()))

    def __reduce__(self):
        return (ExpertLayout, self._key())

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def slots_per_rank(self) -> int:
        return self.experts_per_rank + self.redundant_slots

    @property
    def num_physical(self) -> int:
        return self.num_ranks * self.slots_per_rank

    @property
    def num_domains(self) -> int:
        return self.num_ranks // self.domain_size

    def master_rank(self, expert: int) -> int:
        self._check_index("expert", expert, self.num_experts)
        return expert // self.experts_per_rank

    def domain_of(self, rank: int) -> int:
        self._check_index("rank", rank, self.num_ranks)
        return rank // self.domain_size

    def physical_slot(self, rank: int, j: int) -> int:
        self._check_index("rank", rank, self.num_ranks)
        self._check_index("slot", j, self.slots_per_rank)
        return rank * self.slots_per_rank + j

    def master_slot(self, expert: int) -> int:
        """Physical slot of ``expert``'s master."""
        rank = self.master_rank(expert)
        return self.physical_slot(rank, expert - rank * self.experts_per_rank)

    @staticmethod
    def _check_index(name, value, bound):
        if not 0 <= value < bound:
            raise ValueError(f"{name} {value} out of range [0, {bound})")
