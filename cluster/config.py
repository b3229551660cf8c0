"""The one configuration tree of a tierserve cluster (STYLE.md item 8).

Data flow: a YAML file (optional) -> a plain dict -> ``--set a.b=c`` overrides and the
few direct flags of ``tierserve serve`` -> :class:`ClusterConfig` (pydantic v2, frozen,
``extra="forbid"``) -> typed pieces handed to the rest of the code: ``tiers`` converts
to ``scheduler.tiers.TierConfig``, ``pools`` becomes each worker's engine settings,
``topology`` declares nodes and NVLink domains on machines without NVML.

Every error is a :class:`ConfigError` whose message names the field
(``pools.num_decode: ...``). Environment variables are read here and nowhere else
(:func:`read_environment`).
"""

from __future__ import annotations

import enum
import ipaddress
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.key_digests import KeyDigest, hash_keys, new_salt, parse_key_lines
from scheduler.pool_planner import PlannerSettings, PoolLimits
from scheduler.tiers import (
    ConfigError,
    ShareMode,
    TierConfig,
    TierSpec,
    cpu_tiers,
    default_tiers,
)

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "EnvSettings",
    "ModelConfig",
    "PoolsConfig",
    "RouterConfig",
    "SchedulingConfig",
    "TenantConfig",
    "TiersConfig",
    "TopologyConfig",
    "TracingConfig",
    "WorkerPlacement",
    "check_key_files",
    "load_config",
    "parse_overrides",
    "read_environment",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Frozen):
    # A checkpoint folder (transformers layout or a GGUF file), or "default":
    # the embedded model that `tierserve prepare-model` builds.
    path: str = "default"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # How attention reads the paged KV: "auto" (FlexAttention through block tables on CUDA,
    # the native CPU kernels on CPU), "paged" (block-major pool; gathered SDPA on CUDA) or
    # "flex" (layer-major pool; eager and slow on CPU). engine/README.md says why.
    attention: Literal["auto", "paged", "flex"] = "auto"
    # The name clients pass as `model`; empty means the checkpoint folder's name.
    served_name: str = ""
    # path "stub" only (engine/stub.py): seconds each step sleeps, fixed and per token
    # computed, so each stub worker has a capacity of its own (tierserve bench-scale).
    stub_step_s: float = Field(0.0, ge=0, le=10)
    stub_token_s: float = Field(0.0, ge=0, le=1)


class PoolsConfig(_Frozen):
    # Where prefills run (DESIGN §1): on prefill workers with the KV streamed to the decode
    # worker ("disaggregated"), on the decode worker itself ("aggregated": no prefill
    # workers are needed), or chosen per request by the kernel ("auto"). Unset: by device,
    # resolved like ``tiers.preset`` (disaggregated when the workers get GPUs, auto
    # without: on the 2-core CPU machine auto measured best, README "Where prefills run").
    mode: Literal["disaggregated", "aggregated", "auto"] | None = None
    # auto: prompts (less their prefix-cache hit) longer than this always go to a prefill
    # worker; shorter ones run where the first token is predicted earlier (like Dynamo's
    # max_local_prefill_length).
    auto_local_prefill_max_tokens: int = Field(1024, ge=0)
    num_prefill: int = Field(1, ge=0, le=64)
    num_decode: int = Field(1, ge=1, le=64)
    # Ray resources per worker: fractional CPUs on CPU machines, one GPU on GPU nodes.
    num_cpus_per_worker: float = Field(0.5, gt=0)
    num_gpus_per_worker: float = Field(0.0, ge=0)
    block_size: int = Field(16, ge=1, le=256)
    # The KV budget of each worker (DESIGN §3: blocks are the unit), at most one of: a block
    # count, bytes, or a share of the device's available memory when the worker starts (host
    # MemAvailable on CPU, free memory after the weights on CUDA). None set: the engine's
    # default, a tenth of available memory (on a 24 GiB CPU host ~2 GiB a worker, leaving
    # the other worker, Ray and the OS room; engine/README.md). A budget the device cannot
    # hold fails the worker's start with an error naming the field and the limit.
    num_kv_blocks: int | None = Field(None, ge=2)
    kv_cache_bytes: int | None = Field(None, ge=1)
    kv_cache_memory_fraction: float | None = Field(None, gt=0, le=0.95)
    # The host swap space of each decode worker (engine/swap_space.py): at most this many
    # KV blocks swapped out at once, and at most ``swap_bytes`` when set (the smaller wins).
    # When it is full the kernel preempts by migration or recompute instead; a swap that
    # would not fit is never attempted. 0: never swap.
    num_swap_blocks: int = Field(512, ge=0)
    swap_bytes: int | None = Field(None, ge=0)
    # Reuse of cached KV blocks across requests (a prompt's shared prefix, a recompute's own
    # blocks still cached). Off: every prefill and recompute computes all its tokens (a
    # measurement of the uncached cost, bench-pressure's migration probe).
    prefix_caching: bool = True
    prefill_chunk_size: int = Field(256, ge=1)
    # CUDA graphs of decode-only steps up to this batch (flex attention on CUDA); 0: none.
    cuda_graph_max_batch: int = Field(64, ge=0, le=1024)
    max_num_batched_tokens: int = Field(1024, ge=1)
    # Sequences in one engine step (vLLM's CPU server default, 128); within it the step
    # planner sizes the decode batch to the tiers' TPOT targets.
    max_num_seqs: int = Field(128, ge=1)
    # torch intra-op threads per worker (1 keeps many actors on few cores fair).
    torch_threads: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> PoolsConfig:
        if self.mode != "aggregated" and self.num_prefill < 1:
            mode = self.mode or "unset (by device: auto or disaggregated)"
            raise ValueError(f"num_prefill: mode {mode} needs at least one prefill worker "
                             "(mode aggregated needs none)")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        budgets = [name for name in ("num_kv_blocks", "kv_cache_bytes", "kv_cache_memory_fraction")
                   if getattr(self, name) is not None]
        if len(budgets) > 1:
            raise ValueError(f"{budgets[0]}: give one KV budget, not {' and '.join(budgets)}")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                "prefill_chunk_size: must not exceed max_num_batched_tokens "
                f"({self.prefill_chunk_size} > {self.max_num_batched_tokens})"
            )
        return self


class TierEntry(_Frozen):
    name: str
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    share: float
    weight: float = 1.0
    preempt_threshold: float = 0.9
    max_starvation_s: float = 60.0


class TiersConfig(_Frozen):
    # Empty: the preset's four tiers (DESIGN §5). "gpu": 200 ms TTFT / 50 ms TPOT for
    # tier 0; "cpu": 1 s / 250 ms, targets a CPU engine can meet; "auto": cpu unless the
    # workers get GPUs (resolved by :func:`resolve_presets` before the tree is shipped).
    preset: Literal["auto", "gpu", "cpu"] = "auto"
    tiers: tuple[TierEntry, ...] = ()
    share_mode: Literal["soft", "quota"] = "soft"
    anti_thrash_s: float = 1.0
    boost_fraction: float = 0.7
    control_interval_s: float = 0.1
    max_share_step: float = 0.10

    def to_tier_config(self) -> TierConfig:
        """The kernel's frozen TierConfig; raises ConfigError naming ``tiers.…``."""
        base = cpu_tiers() if self.preset == "cpu" else default_tiers()
        specs = (
            tuple(TierSpec(**t.model_dump()) for t in self.tiers) if self.tiers else base.tiers
        )
        try:
            return TierConfig(
                tiers=specs,
                share_mode=ShareMode(self.share_mode),
                anti_thrash_s=self.anti_thrash_s,
                boost_fraction=self.boost_fraction,
                control_interval_s=self.control_interval_s,
                max_share_step=self.max_share_step,
            )
        except ConfigError as e:
            raise ConfigError(f"tiers.{e}") from None

    @model_validator(mode="after")
    def _check(self) -> TiersConfig:
        try:
            self.to_tier_config()
        except ConfigError as e:  # re-rooted at this section by _describe
            raise ValueError(str(e).removeprefix("tiers.")) from None
        return self


class SchedulingConfig(_Frozen):
    # A name from the scheduler's policy registry ("tierserve", "vllm-fcfs", ...), with
    # its settings if any ("tierserve:ordering=wfq"; scheduler/policy_spec.py).
    policy: str = "tierserve"
    # How often the global scheduler runs its deadline watcher and fair-share update.
    control_interval_s: float = Field(0.1, gt=0)
    # A worker that has requests to step and makes no engine step (or sends no report) for
    # this long is hung: the scheduler kills it and Ray starts it again (cluster/
    # supervisor.py). Keep it above the longest step a worker may take (a long prefill
    # chunk on a CPU takes seconds).
    worker_stall_timeout_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> SchedulingConfig:
        from scheduler.policies import check_policy

        try:
            check_policy(self.policy)
        except ValueError as e:
            raise ValueError(f"policy: {e}") from None
        return self


class WorkerPlacement(_Frozen):
    node: str = Field(min_length=1)
    nvlink_domain: str = Field(min_length=1)


class TopologyConfig(_Frozen):
    """Declared topology for machines without NVML: one entry per worker, in order.

    Empty lists mean "all workers on the driver's node, one domain". On GPU nodes the
    workers read their device and domain from NVML and only fall back to this.
    ``node`` may name a Ray custom resource (``node:<name>``) the worker is pinned to.
    """

    prefill: tuple[WorkerPlacement, ...] = ()
    decode: tuple[WorkerPlacement, ...] = ()
    # Pin each worker to its declared node through the Ray resource ``node_<name>``.
    pin_to_node_resource: bool = False


class RouterConfig(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # A Ray instance that `tierserve serve` starts itself runs Ray Serve in its throughput
    # mode: the router replica serves ``port`` directly, without the proxy's extra hop
    # (about a third more requests per second on two cores; `tierserve bench-control`).
    # Joining a cluster (--address, KubeRay) keeps Serve's proxy.
    direct_ingress: bool = True
    # The most a request may take end to end before the router aborts it.
    request_timeout_s: float = Field(600.0, gt=0)
    # Timeout for one control call (admit, abort, poll) to an actor.
    rpc_timeout_s: float = Field(10.0, gt=0)
    # A request retried after its worker failed ends with a clear error when the retry has
    # streamed nothing this long after the router heard of the failure (0: wait as long as
    # request_timeout_s). A death is detected within 3 s (the supervisor's ping timeout;
    # a killed actor's calls fail sooner), so 7 s keeps every request in flight at a
    # fault resumed or clearly ended within 10 s of it.
    retry_resume_timeout_s: float = Field(7.0, ge=0)
    max_tokens_limit: int = Field(4096, ge=1)
    default_max_tokens: int = Field(256, ge=1)
    # Sequences one request may ask the engines for (prompts x n, or x best_of): more is a
    # 400 (64 prompts x best_of 16 would be 1,024 sequences of one client's request).
    max_sequences_per_request: int = Field(64, ge=1)
    # Request bodies over this many bytes are refused (413) before they are parsed.
    max_body_bytes: int = Field(4 << 20, ge=1024)
    # Serve without API keys (no tenant has one) on an address other than loopback. Off:
    # such a configuration is refused, so open access never reaches a network by accident.
    allow_open_access: bool = False
    # /metrics answers without a key even when keys are required (a Prometheus scraper
    # inside the cluster); off: /metrics needs a key like every endpoint but /health.
    open_metrics: bool = False
    # How often the router re-reads the tenants' api_keys_file (key rotation without a
    # restart). A Kubernetes Secret reaches a mounted file within about a minute of an
    # update (the kubelet's sync period), then within this of that here.
    key_reload_interval_s: float = Field(10.0, gt=0)

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name
            return False


class TenantConfig(_Frozen):
    """A caller and its tier. Keys are never printed (not in a repr, an error or a log
    line) and never kept: ``api_keys`` given here are turned into keyed digests when the
    tree is built (router/key_digests.py), so every copy of the tree holds digests."""

    name: str = Field(min_length=1)
    # Digests of the tenant's keys, ``hmac-sha256$<salt>$<digest>``: what ``api_keys``
    # (listed, or read from ``api_keys_env`` by load_config) become. A digest may also be
    # written here directly, to keep a key out of a configuration file.
    api_key_digests: tuple[str, ...] = Field((), repr=False)
    # A file with one key per line ('#' comments), read by the router alone, at start and
    # again whenever it changes (router.key_reload_interval_s): rotation without a restart.
    api_keys_file: str | None = None
    # An environment variable holding keys separated by commas or white space, read
    # when the configuration is loaded (load_config); rotating them needs a restart.
    api_keys_env: str | None = None
    tier: int = Field(1, ge=0)
    may_override_tier: bool = False
    # The most urgent tier the tenant may choose (smaller is more urgent); unset: its own
    # tier, so an override can only lower its priority.
    max_tier_override: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _hash_listed_keys(cls, data: Any) -> Any:
        # A tenant built alone; inside a ClusterConfig, _hash_tenant_keys got there first.
        if isinstance(data, Mapping) and "api_keys" in data:
            data = _hash_tenant_keys({"tenants": [data]})["tenants"][0]
        return data

    @model_validator(mode="after")
    def _check(self) -> TenantConfig:
        for i, d in enumerate(self.api_key_digests):
            try:
                KeyDigest.parse(d)
            except ValueError as e:
                raise ValueError(f"api_key_digests[{i}]: {e}") from None
        return self

    @property
    def has_keys(self) -> bool:
        return bool(self.api_key_digests) or self.api_keys_file is not None

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is one of the tenant's listed (hashed) keys."""
        return any(KeyDigest.parse(d).matches(key) for d in self.api_key_digests)


def _hash_tenant_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """The tree with each tenant's plain ``api_keys`` replaced by keyed digests under one
    fresh salt, after refusing empty keys and a key given to two tenants (errors name
    the tenant, never the key)."""
    tree = dict(data)
    tenants = tree.get("tenants")
    if not isinstance(tenants, (list, tuple)):
        return tree
    salt = new_salt()
    seen: dict[str, str] = {}
    out: list[Any] = []
    for i, t in enumerate(tenants):
        if not isinstance(t, Mapping) or "api_keys" not in t:
            out.append(t)
            continue
        t = dict(t)
        keys = t.pop("api_keys") or ()
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"tenants[{i}].api_keys: expected a list of strings")
        for key in keys:
            if not key:
                raise ValueError(f"tenants[{i}].api_keys: an empty key is not allowed")
            if key in seen:
                raise ValueError(f"tenants[{i}].api_keys: key already belongs to tenant "
                                 f"{seen[key]!r}")
            seen[key] = str(t.get("name"))
        t["api_key_digests"] = (*(t.get("api_key_digests") or ()),
                                *(d.text() for d in hash_keys(keys, salt)))
        out.append(t)
    tree["tenants"] = out
    return tree


DEFAULT_TRACE_FILE = "tierserve-traces.jsonl"


class TracingConfig(_Frozen):
    """OpenTelemetry traces of requests (cluster/tracing.py), written by the global
    scheduler when a request ends. Off by default (no file appears unasked).

    Enabled: OTLP to ``otlp_endpoint`` when set (``http://collector:4318``; needs the
    ``opentelemetry-exporter-otlp-proto-http`` package, or ``-grpc`` for protocol
    ``grpc``), else one JSON span per line appended to ``jsonl_path`` (default
    ``tierserve-traces.jsonl`` in the scheduler actor's working directory; give an
    absolute path on a cluster).
    """

    enabled: bool = False
    otlp_endpoint: str | None = None
    otlp_protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    jsonl_path: str | None = None
    service_name: str = Field("tierserve", min_length=1)

    @property
    def trace_file(self) -> str:
        return self.jsonl_path or DEFAULT_TRACE_FILE


class PlannerConfig(_Frozen):
    """The SLO planner (``scheduler/pool_planner.py``): sizes the prefill and decode pools
    from tier-0 attainment, each pool's busy fraction and decode KV in use, one worker per
    pool per ``cooldown_s`` at most, within ``min_*``/``max_*``. Off by default: the pools
    keep ``pools.num_prefill``/``pools.num_decode`` (which must lie within the bounds
    when it is on; they are its starting sizes)."""

    enabled: bool = False
    interval_s: float = Field(10.0, gt=0)  # one decision per window
    cooldown_s: float = Field(20.0, ge=0)
    down_stable_s: float = Field(45.0, ge=0)
    min_prefill: int = Field(1, ge=0, le=64)
    max_prefill: int = Field(4, ge=0, le=64)
    min_decode: int = Field(1, ge=1, le=64)
    max_decode: int = Field(4, ge=1, le=64)
    target_attainment: float = Field(0.99, gt=0, le=1)
    busy_high: float = Field(0.85, gt=0, le=1)
    busy_low: float = Field(0.45, ge=0, lt=1)
    kv_high: float = Field(0.85, gt=0, le=1)
    kv_low: float = Field(0.45, ge=0, lt=1)
    max_total_workers: int | None = Field(None, ge=2)
    allow_role_moves: bool = False

    @model_validator(mode="after")
    def _check(self) -> PlannerConfig:
        self.settings()  # the pure object's own checks, with its messages
        return self

    def settings(self) -> PlannerSettings:
        return PlannerSettings(
            prefill=PoolLimits(self.min_prefill, self.max_prefill),
            decode=PoolLimits(self.min_decode, self.max_decode),
            cooldown_s=self.cooldown_s, down_stable_s=self.down_stable_s,
            target_attainment=self.target_attainment, busy_high=self.busy_high,
            busy_low=self.busy_low, kv_high=self.kv_high, kv_low=self.kv_low,
            max_total=self.max_total_workers, allow_role_moves=self.allow_role_moves)


class ClusterConfig(_Frozen):
    model: ModelConfig = ModelConfig()
    pools: PoolsConfig = PoolsConfig()
    tiers: TiersConfig = TiersConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    topology: TopologyConfig = TopologyConfig()
    router: RouterConfig = RouterConfig()
    tenants: tuple[TenantConfig, ...] = ()
    tracing: TracingConfig = TracingConfig()
    planner: PlannerConfig = PlannerConfig()
    # Ray address to join ("auto", "ray://...", host:port); None starts a local instance.
    ray_address: str | None = None
    # Set only on the copy sent to the scheduler and the workers (without_keys): its
    # tenants carry no key material, and the access check was made where keys are.
    keys_withheld: bool = False

    @model_validator(mode="before")
    @classmethod
    def _hash_keys(cls, data: Any) -> Any:
        return _hash_tenant_keys(data) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.model.path == "stub" and self.pools.mode != "aggregated":
            raise ValueError("model.path: the stub engine (no model, for bench-control) runs "
                             "only with pools.mode aggregated: it has no KV to transfer")
        pl = self.planner
        if pl.enabled:
            sizes = [("num_decode", self.pools.num_decode, pl.min_decode, pl.max_decode)]
            if self.pools.mode != "aggregated":
                sizes.append(("num_prefill", self.pools.num_prefill, pl.min_prefill,
                              pl.max_prefill))
            for name, n, lo, hi in sizes:
                if not lo <= n <= hi:
                    raise ValueError(f"pools.{name} {n}: the planner starts from it, so it "
                                     f"must lie within planner bounds [{lo}, {hi}]")
        num_tiers = self.tiers.to_tier_config().num_tiers
        seen: dict[str, str] = {}
        for i, t in enumerate(self.tenants):
            if t.tier >= num_tiers:
                raise ValueError(f"tenants[{i}].tier: {t.tier} but only {num_tiers} tiers exist")
            if t.max_tier_override is not None and t.max_tier_override >= num_tiers:
                raise ValueError(f"tenants[{i}].max_tier_override: {t.max_tier_override} but "
                                 f"only {num_tiers} tiers exist")
            if t.api_keys_env is not None:
                raise ValueError(f"tenants[{i}].api_keys_env: not read; load the configuration "
                                 "with load_config (tierserve serve, the Serve app builder)")
            if self.keys_withheld and t.api_key_digests:
                raise ValueError(f"tenants[{i}].api_key_digests: a tree with keys_withheld "
                                 "carries no key material")
            if t.name in seen:
                raise ValueError(f"tenants[{i}].name: {t.name!r} is tenants[{seen[t.name]}]'s")
            seen[t.name] = str(i)
        if not self.requires_api_key and not self.router.is_loopback \
                and not self.router.allow_open_access and not self.keys_withheld:
            raise ValueError(f"router.host: {self.router.host} is not a loopback address and no "
                             "tenant has an API key: anyone who reaches it could use the "
                             "server. Give tenants api_keys (or api_keys_file / api_keys_env), "
                             "or set router.allow_open_access: true to serve without keys")
        for pool, entries, n in (
            ("prefill", self.topology.prefill, self.pools.num_prefill),
            ("decode", self.topology.decode, self.pools.num_decode),
        ):
            if entries and len(entries) != n:
                raise ValueError(
                    f"topology.{pool}: {len(entries)} entries for {n} {pool} workers"
                )
        return self

    @property
    def tier_config(self) -> TierConfig:
        return self.tiers.to_tier_config()

    @property
    def pool_mode(self) -> str:
        return self.pools.mode or ("disaggregated" if self.uses_gpus else "auto")

    def planner_settings(self) -> PlannerSettings:
        """The SLO planner's settings; an aggregated cluster has no prefill pool to size
        (its decode workers prefill: the planner reads prefill's signals for them)."""
        st = self.planner.settings()
        if self.pool_mode == "aggregated":
            st = replace(st, prefill=PoolLimits(0, 0))
        return st

    @property
    def uses_gpus(self) -> bool:
        return self.pools.num_gpus_per_worker > 0 or self.model.device == "cuda"

    def resolve_presets(self) -> ClusterConfig:
        """The tree with the by-device defaults made concrete (``tiers.preset: auto``: cpu
        unless the workers get GPUs; an unset ``pools.mode``: disaggregated on GPUs, auto
        without), so every process that receives it sees the same targets and mode."""
        update: dict[str, Any] = {}
        if self.tiers.preset == "auto":
            preset = "gpu" if self.uses_gpus else "cpu"
            update["tiers"] = self.tiers.model_copy(update={"preset": preset})
        if self.pools.mode is None:
            update["pools"] = self.pools.model_copy(update={"mode": self.pool_mode})
        return self.model_copy(update=update) if update else self

    @property
    def requires_api_key(self) -> bool:
        """Open access until any key is configured (DESIGN: keys required once configured)."""
        return any(t.has_keys for t in self.tenants)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/msgpack types, for shipping to actors. Holds key digests and key file
        paths, never a key: send it whole only to the router (see without_keys)."""
        return self.model_dump(mode="json")

    def without_keys(self) -> ClusterConfig:
        """The tree for processes that check no key (the scheduler, every worker): no
        digest and no key file, only the tenants' names and tiers."""
        tenants = tuple(t.model_copy(update={"api_key_digests": (), "api_keys_file": None})
                        for t in self.tenants)
        return self.model_copy(update={"tenants": tenants, "keys_withheld": True})

    def access_summary(self) -> str:
        """One line for the start banner: how access works on this server."""
        host = self.router.host
        if self.requires_api_key:
            n = sum(1 for t in self.tenants if t.has_keys)
            metrics = "; /metrics open" if self.router.open_metrics else ""
            return (f"access: an API key is required on every endpoint but /health "
                    f"({n} tenant{'s' if n != 1 else ''} with keys){metrics}")
        if self.router.is_loopback:
            return (f"access: open (no API keys configured), bound to {host} only; configure "
                    "tenants with api_keys before serving on another address")
        return (f"WARNING: access: open to anyone who reaches {host} (no API keys configured; "
                "router.allow_open_access is set)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        try:
            return cls.model_validate(dict(data))
        except ValidationError as e:
            raise ConfigError(_describe(e)) from None


_FIELD_PATH = re.compile(r"[A-Za-z_][\w.\[\]*]*")


def _describe(err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        loc = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in item["loc"])
        loc = loc.replace(".[", "[")
        msg = str(item["msg"]).removeprefix("Value error, ")
        head, sep, rest = msg.partition(": ")
        if loc and sep and _FIELD_PATH.fullmatch(head):
            # A section's own check names a field inside it: join the two paths.
            msg = f"{loc}{'' if head.startswith('[') else '.'}{head}: {rest}"
        elif loc and not msg.startswith(loc):
            msg = f"{loc}: {msg}"
        parts.append(msg)
    return "; ".join(parts)


class EnvSettings(enum.Enum):
    """The environment variables tierserve reads (in :func:`read_environment` only)."""

    CONFIG = "TIERSERVE_CONFIG"
    MODEL = "TIERSERVE_MODEL"
    RAY_ADDRESS = "RAY_ADDRESS"


def read_environment(environ: Mapping[str, str] | None = None) -> dict[EnvSettings, str]:
    env = os.environ if environ is None else environ
    return {k: env[k.value] for k in EnvSettings if env.get(k.value)}


def parse_overrides(items: Iterable[str]) -> list[tuple[tuple[str, ...], Any]]:
    """``["pools.num_decode=2", "router.host=0.0.0.0"]`` -> [(path, YAML-parsed value)]."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. pools.num_decode=2")
        path = tuple(p for p in key.strip().split("."))
        if any(not p for p in path):
            raise ConfigError(f"--set {item!r}: empty component in {key!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: value is not valid YAML ({e})") from None
        out.append((path, value))
    return out


def _apply(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is not a section, cannot set {'.'.join(path)}")
        node = nxt
    node[path[-1]] = value


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    direct: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ClusterConfig:
    """File (or $TIERSERVE_CONFIG) < environment < ``--set`` overrides < direct flags.

    ``direct`` maps dotted keys to values from explicit flags (``{"model.path": p}``);
    ``None`` values are skipped so unset flags do not override the file.
    """
    env = read_environment(environ)
    if path is None and EnvSettings.CONFIG in env:
        path = env[EnvSettings.CONFIG]
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text())
        except OSError as e:
            raise ConfigError(f"config file {p}: cannot read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p}: not valid YAML ({e})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping")
        tree = loaded or {}
    if EnvSettings.MODEL in env:
        _apply(tree, ("model", "path"), env[EnvSettings.MODEL])
    environ_map = os.environ if environ is None else environ
    if EnvSettings.RAY_ADDRESS in env:
        tree.setdefault("ray_address", env[EnvSettings.RAY_ADDRESS])
    for key, value in parse_overrides(overrides):
        _apply(tree, key, value)
    for key, value in (direct or {}).items():
        if value is not None:
            _apply(tree, tuple(key.split(".")), value)
    if tree.get("keys_withheld"):
        raise ConfigError("keys_withheld: set only on the copy of the tree tierserve sends to "
                          "its scheduler and workers, not in a configuration")
    _read_key_sources(tree, environ_map)
    return ClusterConfig.from_dict(tree).resolve_presets()


def _read_key_sources(tree: dict[str, Any], environ: Mapping[str, str]) -> None:
    """Add each tenant's keys from its ``api_keys_env`` to its ``api_keys`` (the variable
    is then dropped; the keys become digests when the tree is built). ``api_keys_file``
    stays a path: the router reads it (router/key_files.py). Errors name the field,
    never a key."""
    tenants = tree.get("tenants")
    if not isinstance(tenants, list):
        return
    for i, t in enumerate(tenants):
        if not isinstance(t, dict):
            continue
        var = t.pop("api_keys_env", None)
        if var is None:
            continue
        env_keys = environ.get(str(var), "").replace(",", " ").split()
        if not env_keys:
            raise ConfigError(f"tenants[{i}].api_keys_env: ${var} is not set or is empty")
        t["api_keys"] = [*(t.get("api_keys") or []), *env_keys]


def check_key_files(cfg: ClusterConfig) -> None:
    """Read every tenant's ``api_keys_file`` once, for a clear error before serving where
    the router will run on this machine (``tierserve serve``); the router reads them
    itself. ConfigError naming the field and the file, never a key."""
    for i, t in enumerate(cfg.tenants):
        if t.api_keys_file is None:
            continue
        try:
            text = Path(t.api_keys_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise ConfigError(f"tenants[{i}].api_keys_file: cannot read {t.api_keys_file} "
                              f"({why})") from None
        if not parse_key_lines(text):
            raise ConfigError(f"tenants[{i}].api_keys_file: {t.api_keys_file} holds no key")
