"""A limiter's stored state, as JSON in its row: the limits every process shares, and the
rates and pushback state that the allocation reads and changes."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from .._config import Adaptive, Rate, Settings, Workload
from .._core.adaptive import Aimd
from .._core.rates import Bank
from .._core.rules import Rules

__all__ = (
    "Pace",
    "adaptive_json",
    "adaptive_params",
    "limits_json",
    "rate_json",
    "settings_kwargs",
    "stored_limits",
)


@attrs.define(kw_only=True, eq=False)
class Pace:
    """The rates and pushback state stored with a limiter's row, loaded for one
    transaction: the values that MemoryLimiter keeps in memory, changed by the same rules
    (slotwise._core.state), on the database clock."""

    bank: Bank
    paused_until: float
    backoffs: int
    aimd: Aimd | None
    dirty: bool = False  # changed: to be stored

    @classmethod
    def load(
        cls,
        settings: Settings,
        buckets: Mapping[str, Any] | None,
        paused_until: float | None,
        backoffs: int | None,
        adaptive: Mapping[str, Any] | None,
    ) -> Pace:
        # Buckets not stored yet are full, as if they had been refilling forever.
        bank = Bank(settings.rules.buckets, -math.inf)
        for key, (level, updated, *learned) in (buckets or {}).items():
            bucket = bank.buckets.get(key)
            if bucket is not None:
                if learned:  # a limit learned from the provider, and until when it stands
                    bucket.learned, bucket.learned_until = map(float, learned)
                bucket.level = min(float(level), bucket.capacity)
                bucket.updated = float(updated)
        aimd = None
        if settings.adaptive is not None:
            floor, ceiling = settings.adaptive.min_concurrent, settings.max_concurrent
            stored = adaptive or {}
            # A limiter with no adaptive state stored yet starts at the floor in slow start.
            slow_start = bool(stored.get("slow_start", not stored and settings.adaptive.slow_start))
            start = floor if slow_start else ceiling
            aimd = Aimd(
                floor=floor,
                ceiling=ceiling,
                backoff=settings.adaptive.backoff,
                limit=min(max(int(stored.get("limit", start)), floor), ceiling),
                epoch=int(stored.get("epoch", 0)),
                credit=float(stored.get("credit", 0.0)),
                slow_start=slow_start,
                proven=int(stored.get("proven", 0)),
            )
        return cls(
            bank=bank,
            paused_until=-math.inf if paused_until is None else float(paused_until),
            backoffs=int(backoffs or 0),
            aimd=aimd,
        )

    def limit(self, settings: Settings) -> int:
        """The limit in force."""
        return settings.max_concurrent if self.aimd is None else self.aimd.limit

    def rules(self, settings: Settings) -> Rules:
        if self.aimd is None:
            return settings.rules
        return attrs.evolve(settings.rules, max_concurrent=self.aimd.limit)

    def params(self) -> dict[str, Any]:
        return {
            "buckets": json.dumps(
                {
                    key: [bucket.level, bucket.updated]
                    + (
                        [bucket.learned, bucket.learned_until]
                        if math.isfinite(bucket.learned)
                        else []
                    )
                    for key, bucket in self.bank.buckets.items()
                    if math.isfinite(bucket.updated)
                }
            ),
            "paused_until": None if self.paused_until == -math.inf else self.paused_until,
            "backoffs": self.backoffs,
            "adaptive": None
            if self.aimd is None
            else json.dumps(
                {
                    "limit": self.aimd.limit,
                    "epoch": self.aimd.epoch,
                    "credit": self.aimd.credit,
                    "slow_start": self.aimd.slow_start,
                    "proven": self.aimd.proven,
                }
            ),
        }


def stored_limits(settings: Settings) -> dict[str, Any]:
    """The limits every process sharing a name must agree on (lease and entry TTLs, the
    default workload and poll interval are each process's own). Settings that came later
    (rates, pushback, per-workload queue bounds) appear only when set, so that limits
    stored by an earlier version still agree."""
    workloads: dict[str, Any] = {}
    for name, rule in settings.rules.workloads.items():
        workload = settings.workloads[name]
        stored = workloads[name] = {
            "max_concurrent": rule.ceiling,
            "reserved": rule.reserved,
            "priority": rule.priority,
            "max_wait": workload.max_wait,
        }
        if workload.max_queued is not None:
            stored["max_queued"] = workload.max_queued
        if workload.rate is not None:
            stored["rate"] = rate_json(workload.rate)
    limits: dict[str, Any] = {
        "max_concurrent": settings.max_concurrent,
        "max_queued": settings.max_queued,
        "workloads": workloads,
    }
    if settings.rate is not None:
        limits["rate"] = rate_json(settings.rate)
    if settings.adaptive is not None:
        limits["adaptive"] = adaptive_json(settings.adaptive)
    return limits


def limits_json(settings: Settings) -> dict[str, Any]:
    """The limits set by `set_limits()`, as stored for every process (each keeps its own
    lease_ttl and default workload): the settings as given, a workload's ceiling None when
    it follows the limiter's."""
    return {
        "max_concurrent": settings.max_concurrent,
        "max_queued": settings.max_queued,
        "workloads": {
            name: {
                "max_concurrent": w.max_concurrent,
                "reserved": w.reserved,
                "priority": w.priority,
                "max_wait": w.max_wait,
                "max_queued": w.max_queued,
                "rate": None if w.rate is None else rate_json(w.rate),
            }
            for name, w in settings.workloads.items()
        },
        "rate": None if settings.rate is None else rate_json(settings.rate),
        "adaptive": None if settings.adaptive is None else adaptive_json(settings.adaptive),
    }


def settings_kwargs(limits: Mapping[str, Any]) -> dict[str, Any]:
    """`build_settings` keywords from `limits_json()`."""

    def rate(stored: Mapping[str, Any] | None) -> Rate | None:
        return None if stored is None else Rate(**stored)

    return {
        "max_concurrent": limits["max_concurrent"],
        "max_queued": limits["max_queued"],
        "workloads": {
            name: Workload(**{**w, "rate": rate(w.get("rate"))})
            for name, w in limits["workloads"].items()
        },
        "rate": rate(limits.get("rate")),
        "adaptive": None if limits.get("adaptive") is None else Adaptive(**limits["adaptive"]),
    }


def rate_json(rate: Rate) -> dict[str, Any]:
    return {"requests": rate.requests, "tokens": rate.tokens, "per": float(rate.per)}


def adaptive_json(adaptive: Adaptive) -> dict[str, Any]:
    stored: dict[str, Any] = {
        "min_concurrent": adaptive.min_concurrent,
        "backoff": float(adaptive.backoff),
    }
    if adaptive.slow_start:  # stored only when set: limits stored without it still match
        stored["slow_start"] = True
    return stored


def adaptive_params(settings: Settings) -> tuple[int, float] | None:
    adaptive = settings.adaptive
    return None if adaptive is None else (adaptive.min_concurrent, adaptive.backoff)
