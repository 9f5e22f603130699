"""Structured configs (dataclasses registered in Hydra's ConfigStore) and their validation.

`validate` runs before anything compiles and raises ConfigError with one message naming the field,
its value and what would be valid. Never build models or workloads here.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jax
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from jaxbatch.model.hf import CheckpointError, read_config
from jaxbatch.model.kernels import ATTENTION, choose
from jaxbatch.model.spec import DTYPES, ModelSpec

# The configs live beside the package (DESIGN.md layout); an editable install finds them here.
CHECKOUT = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(CHECKOUT / "configs")
# Policy names a config may give: the package's own, then those `sched.policies.register_policy`
# adds (a `policy.module` file or module registers them when the config is validated). The
# budgeted ones run mixed passes under `policy.token_budget`.
POLICY_NAMES = ["static", "continuous", "orca", "chunked"]
BUDGETED_POLICIES = ["orca", "chunked"]
_loaded_policy_modules: set[str] = set()


def add_policy_name(name: str, budgeted: bool) -> None:
    """A name `register_policy` has given a policy (see POLICY_NAMES)."""
    if name not in POLICY_NAMES:
        POLICY_NAMES.append(name)
    if budgeted and name not in BUDGETED_POLICIES:
        BUDGETED_POLICIES.append(name)


def policy_file(module: str) -> Path | None:
    """The file `policy.module` names: a `.py` path (a relative one from the working folder,
    else from the checkout), or an importable module's source; None if it has none."""
    if module.endswith(".py"):
        path = Path(module)
        return path if path.is_absolute() or path.exists() else CHECKOUT / path
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def load_policies(module: str) -> None:
    """Import `module`, a Python file's path (`.py`; a relative one from the working folder,
    else from the checkout, as the experiment presets name theirs) or an importable module's
    name, once per process: it registers its policies (`jaxbatch.sched.policies.register_policy`).
    A file that cannot be read or run is a ConfigError naming `policy.module`."""
    is_file = module.endswith(".py")
    path = policy_file(module) if is_file else Path(module)
    key = str(path.resolve()) if is_file else module
    if key in _loaded_policy_modules:
        return
    # a file's own module name (two files of one name are two modules)
    name = f"jaxbatch_policies_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    try:
        if is_file:
            if not path.is_file():
                raise FileNotFoundError(f"no file {path.resolve()}")
            spec = importlib.util.spec_from_file_location(name, path)
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[name] = loaded  # as an import would: its dataclasses look it up
            spec.loader.exec_module(loaded)
        else:
            importlib.import_module(module)
    except Exception as err:  # noqa: BLE001  any failure of the user's code: one message
        sys.modules.pop(name, None)
        why = f"could not load it ({type(err).__name__}: {err}); give a .py file's path or "
        why += "an importable module that calls register_policy"
        raise ConfigError("policy.module", module, why) from None
    _loaded_policy_modules.add(key)


PRESETS = (  # configs/model/: dimensions of public models, for the cost model
    "llama2_7b", "llama2_13b", "llama2_70b", "llama3_8b", "llama3_70b", "mistral_7b", "qwen2_5_7b",
    "gpt3_13b", "gpt3_175b", "opt_13b", "llama3_2_1b",
)  # fmt: skip
MODEL_NAMES = ("tiny", "small", "tiny_trained", "custom", "hf", *PRESETS)
HARDWARE_NAMES = (
    "none", "a100_40gb", "a100_80gb", "h100_sxm", "h200", "tpu_v5e", "tpu_v5p", "tpu_v6e",
    "cpu_local", "custom",
)  # fmt: skip
BACKENDS = ("runner", "simulator")
CLOCKS = ("auto", "measured", "passes", "priced")
LOOPS = ("auto", "host", "device")
DECODE_ROWS = ("compact", "all")


class ConfigError(ValueError):
    """One bad config field: the message says which, its value, and what is valid."""

    def __init__(self, field_name: str, value, valid: str):
        super().__init__(f"{field_name}={value!r} is not valid: {valid}")


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 2048
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_mlp: int = 688
    max_len: int = 1024
    dtype: str = "float32"  # weights and matmul inputs; accumulation, residual stream: float32
    kv_dtype: str = "auto"  # the KV cache's dtype; auto: model.dtype's
    seed: int = 0
    # A local Hugging Face directory (model=hf): its config.json sets the fields above but
    # max_len, dtype and kv_dtype (`resolve_model`), its safetensors the weights.
    path: str = ""
    head_dim: int = 0  # 0: d_model // n_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    eos_id: int = -1  # the model's end-of-sequence id (config.json's, with model=hf); -1: none
    # A directory jaxbatch-train wrote (orbax params, model.json): its weights (tiny_trained).
    checkpoint: str = ""
    # xla (portable) | cudnn (GPU, bfloat16) | pallas (TPU, paged memory): see model/kernels.py.
    # Where the kernel cannot run, validation says why once and sets xla.
    attention: str = "xla"

    def spec(self) -> ModelSpec:
        return ModelSpec(
            vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, d_mlp=self.d_mlp,
            max_len=self.max_len, dtype=self.dtype, kv_dtype=self.kv_dtype,
            head_size=self.head_dim, rope_theta=self.rope_theta, norm_eps=self.norm_eps,
            qkv_bias=self.qkv_bias, tie_embeddings=self.tie_embeddings, attention=self.attention,
        )  # fmt: skip


def model_preset(name: str) -> ModelConfig:
    """A model of configs/model/ by name, as Hydra would compose it."""
    fields = OmegaConf.to_container(OmegaConf.load(Path(CONFIG_DIR) / "model" / f"{name}.yaml"))
    return ModelConfig(**fields)


def resolve_model(m: ModelConfig) -> None:
    """With `model.path`, set the model's fields from its config.json (in place), refusing a
    checkpoint we cannot run, or a max_len beyond what it was trained for or its sliding window."""
    if not m.path:
        return
    try:
        fields = read_config(m.path)
    except CheckpointError as err:
        raise ConfigError("model.path", m.path, str(err)) from None
    longest, window = fields.pop("max_positions"), fields.pop("sliding_window")
    for name, value in fields.items():
        setattr(m, name, value)
    for limit, what in ((longest, "max_position_embeddings"), (window, "sliding_window")):
        if limit and m.max_len > limit:
            raise ConfigError("model.max_len", m.max_len, f"its config.json's {what} is {limit}")


@dataclass
class PolicyConfig:
    name: str = "continuous"
    max_wait_s: float = 0.0  # static only: wait up to this long for a full batch
    queue: str = "fcfs"  # admission order: fcfs | spf (shortest prompt first) | priority
    token_budget: int = 512  # orca, chunked: most tokens in one pass (max_num_batched_tokens)
    long_prefill_threshold: int = 0  # chunked: most tokens of one prompt per pass (0: no cap)
    max_partial_prefills: int = 0  # chunked: most prompts fed in one pass (0: no limit)
    # A Python file's path or a module's name, imported before the config is checked: it
    # registers policies of one's own (`sched.policies.register_policy`; README, "Your own policy")
    module: str = ""


@dataclass
class LengthConfig:
    dist: str = "fixed"  # fixed | uniform | lognormal
    mean: float = 32
    low: int = 1
    high: int = 512
    sigma: float = 1.0


@dataclass
class WorkloadConfig:
    # synthetic | trace | text (JSONL prompts, model=hf's tokenizer) | task (tasks.py's digit
    # prompts, for a model jaxbatch-train trained: its EOS decides each output's length)
    kind: str = "synthetic"
    num_requests: int = 32
    arrival: str = "offline"  # offline | poisson | gamma
    rate: float = 10.0  # requests/s for poisson and gamma
    burstiness: float = 1.0  # gamma shape; 1 is Poisson
    prompt: LengthConfig = field(default_factory=LengthConfig)
    output: LengthConfig = field(default_factory=lambda: LengthConfig(mean=64))
    priority_levels: int = 1  # request priorities drawn uniformly from 0..levels-1
    seed: int = 0
    path: str = ""  # trace CSV (Azure schema), or text JSONL
    limit: int = 0  # trace rows to keep, 0 = all
    time_scale: float = 1.0  # multiplies trace arrival times
    length_scale: float = 1.0  # multiplies trace prompt lengths (and outputs, unless output_scale)
    output_scale: float = 0.0  # multiplies trace output lengths; 0: use length_scale
    max_digits: int = 12  # task: digits per prompt, at most (output budget: max_digits + 4)


@dataclass
class EngineConfig:
    backend: str = "runner"  # runner | simulator
    num_slots: int = 8
    # measured (wall time) | passes (one unit a pass) | priced (the cost model's price of each
    # pass, simulator only) | auto: the backend's own, measured on the runner, priced on the
    # simulator
    clock: str = "auto"
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    eos_id: int = -1  # -1: the model's (model.eos_id; none for random-init models)
    ignore_eos: bool = False  # run every request to its output budget, as trace replay requires
    min_bucket: int = 16
    # compact: a decode of at most a quarter of the slots runs only their rows, a power of two of
    # them (as vLLM's CUDA graphs take a bucket of the batch size); all: every decode runs every
    # slot (a fixed batch, as JetStream's decode). Tokens are the same either way.
    decode_rows: str = "compact"
    warmup: bool = True  # False: compile each shape on first use, inside the clock (tests)
    # host: one Python iteration per pass. device: the whole run as one compiled lax.while_loop
    # (on the runner with the measured clock, offline workloads only: it is timed as a whole).
    # auto: the backend's own, host on the runner (each pass timed), device on the simulator
    # (one compiled program a run) unless checkpoints or resume need the host loop.
    loop: str = "auto"
    # JAX's persistent compilation cache: `user` ($XDG_CACHE_HOME or ~/.cache, then
    # jaxbatch/xla), `off`, or a folder. A run whose shapes an earlier run compiled loads them.
    compile_cache: str = "user"


@dataclass
class MemoryConfig:
    layout: str = "contiguous"  # contiguous | paged
    budget_mib: float = 0.0  # KV budget; 0 (and budget_tokens 0): num_slots x max_len positions
    budget_tokens: int = 0  # the budget in KV positions instead of MiB
    block_size: int = 16  # paged: positions per block; must divide model.max_len
    reservation: str = "max_len"  # contiguous: max_len | pow2 | exact (an oracle)
    watermark: float = 0.01  # paged: share of blocks that admission leaves free


@dataclass
class HardwareConfig:
    """The accelerator a simulated run is priced for (configs/hardware/, each with its source)."""

    name: str = "none"  # none: no target hardware
    peak_tflops: float = 0.0  # dense bfloat16
    memory_gb_s: float = 0.0
    memory_gb: float = 0.0
    link_gb_s: float = 0.0  # interconnect, per device
    compute_efficiency: float = 0.7  # shares of peak a pass reaches (calibration fits them)
    memory_efficiency: float = 0.9
    # Attention's rates as a share of the matmuls' (1: the same; calibration fits it, since
    # attention kernels run at their own efficiency).
    attention_efficiency: float = 1.0
    # Price matmuls at the runner's padded shape, as calibration to this machine's runner does
    # (false: at the tokens fed, as for a serving system that pads nothing).
    padded: bool = False
    pass_overhead_us: float = 0.0
    # Added to a prefill pass and to a mixed pass: a pass kind's fixed cost is its own (a
    # mixed pass runs many more operations than a decode; this machine's host loop runs a decode
    # ahead of its plan, a prompt pass only once its plan is known). Calibration measures them.
    prefill_overhead_us: float = 0.0
    mixed_overhead_us: float = 0.0
    # The share of an operation's shorter time (compute or memory) hidden behind the longer: 1,
    # the roofline's max (presets); 0, their sum (one CPU core streams and computes in turn).
    overlap: float = 1.0
    tensor_parallel: int = 1  # devices a model is split over (Megatron-style)


@dataclass
class OutputConfig:
    tokens: bool = False  # write tokens.jsonl
    plots: bool = True
    progress: bool = True
    # Host loop: save the run's whole state into its checkpoint/ every this many passes (0: only
    # when Ctrl-C stops it); `resume=DIR` continues from the latest (resume.py).
    checkpoint_every: int = 0


@dataclass
class MeshConfig:
    """Devices of a real run (engine.backend=runner): a data axis (slots) by a model axis (tensor
    parallelism: heads, KV heads, the MLP's inner dimension). 1 x 1: one device, no sharding."""

    data: int = 1
    model: int = 1


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    # A run's output directory whose checkpoint/ to continue from: the run goes on with the
    # config saved there (every other setting on the command line is ignored).
    resume: str = ""


def _positive(name: str, value) -> None:
    """A number > 0 and finite (NaN fails every comparison, so each check is written to fail)."""
    if not value > 0:
        raise ConfigError(name, value, "must be > 0")
    if not math.isfinite(value):
        raise ConfigError(name, value, "must be a finite number > 0")


def _at_least_zero(name: str, value, note: str = "") -> None:
    """A number >= 0 and finite; `note` says what 0 means."""
    if not value >= 0:
        raise ConfigError(name, value, f"must be >= 0{note}")
    if not math.isfinite(value):
        raise ConfigError(name, value, f"must be a finite number >= 0{note}")


def _one_of(name: str, value, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(name, value, "use one of " + ", ".join(valid))


def resolve_auto(cfg: Config) -> None:
    """engine.clock and engine.loop `auto` become the backend's own, in place, so what a run
    records is never auto: the runner's measured clock and host loop; the simulator's priced
    clock and device loop (the host loop where checkpoints or resume need it). `validate` calls
    it, and `run` does for configs built in code."""
    e, sim = cfg.engine, cfg.engine.backend == "simulator"
    if e.clock == "auto":
        e.clock = "priced" if sim else "measured"
    if e.loop == "auto":
        e.loop = "device" if sim and not (cfg.output.checkpoint_every or cfg.resume) else "host"


def validate(cfg: Config) -> None:
    m, p, w, e = cfg.model, cfg.policy, cfg.workload, cfg.engine
    _one_of("model.name", m.name, MODEL_NAMES)
    if m.name == "hf" and not m.path:
        raise ConfigError("model.path", m.path, "model=hf reads a local Hugging Face directory")
    if m.name == "tiny_trained" and not m.checkpoint:
        raise ConfigError(
            "model.checkpoint", m.checkpoint, "model=tiny_trained loads what jaxbatch-train wrote"
        )
    if m.path and m.checkpoint:
        raise ConfigError("model.checkpoint", m.checkpoint, "give model.path or model.checkpoint")
    resolve_model(m)
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp", "max_len"):
        _positive(f"model.{name}", getattr(m, name))
    _positive("model.rope_theta", m.rope_theta)
    _at_least_zero("model.norm_eps", m.norm_eps)
    _one_of("model.dtype", m.dtype, tuple(DTYPES))
    _one_of("model.kv_dtype", m.kv_dtype, ("auto", *DTYPES))
    if m.d_model % m.n_heads and not m.head_dim:
        raise ConfigError("model.n_heads", m.n_heads, f"must divide d_model={m.d_model}")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError("model.n_kv_heads", m.n_kv_heads, f"must divide n_heads={m.n_heads}")
    if (m.head_dim or m.d_model // m.n_heads) % 2:
        raise ConfigError("model.n_heads", m.n_heads, "the head dimension must be even (RoPE)")
    _one_of("model.attention", m.attention, ATTENTION)
    if cfg.engine.backend == "runner":
        paged, devices = cfg.memory.layout == "paged", cfg.mesh.data * cfg.mesh.model
        m.attention, why = choose(m.attention, jax.default_backend(), m.dtype, paged, devices)
        if why:
            print(f"jaxbatch: model.attention: {why}; using xla", file=sys.stderr)
    if p.module:
        load_policies(p.module)
    _one_of("policy.name", p.name, tuple(POLICY_NAMES))
    _one_of("policy.queue", p.queue, ("fcfs", "spf", "priority"))
    _positive("policy.token_budget", p.token_budget)
    if p.token_budget < cfg.engine.num_slots and p.name in BUDGETED_POLICIES:
        raise ConfigError(
            "policy.token_budget", p.token_budget,
            f"must hold one decode per slot: >= engine.num_slots={cfg.engine.num_slots}",
        )  # fmt: skip
    for name in ("long_prefill_threshold", "max_partial_prefills"):
        _at_least_zero(f"policy.{name}", getattr(p, name), " (0: no limit)")
    _at_least_zero("policy.max_wait_s", p.max_wait_s)
    _one_of("workload.kind", w.kind, ("synthetic", "trace", "text", "task"))
    _at_least_zero("workload.seed", w.seed)  # NumPy's generators take no negative seed
    if w.kind in ("synthetic", "task"):
        _positive("workload.num_requests", w.num_requests)
        _one_of("workload.arrival", w.arrival, ("offline", "poisson", "gamma"))
        _positive("workload.priority_levels", w.priority_levels)
        if w.arrival != "offline":
            _positive("workload.rate", w.rate)
            _positive("workload.burstiness", w.burstiness)
    if w.kind == "task":
        _positive("workload.max_digits", w.max_digits)
        if m.vocab_size < 20:
            raise ConfigError("model.vocab_size", m.vocab_size, "task prompts use ids 0..19")
    elif w.kind == "synthetic":
        for part in ("prompt", "output"):
            d: LengthConfig = getattr(w, part)
            _one_of(f"workload.{part}.dist", d.dist, ("fixed", "uniform", "lognormal"))
            _positive(f"workload.{part}.mean", d.mean)
            if d.dist == "fixed" and d.mean < 1:  # a fixed length is int(mean) tokens
                raise ConfigError(
                    f"workload.{part}.mean", d.mean,
                    "must be >= 1: a fixed length is int(mean) tokens, and every prompt and "
                    "output budget holds at least one",
                )  # fmt: skip
            default = LengthConfig()
            for bound in ("low", "high"):  # a fixed length would silently ignore the range
                if d.dist == "fixed" and getattr(d, bound) != getattr(default, bound):
                    raise ConfigError(
                        f"workload.{part}.{bound}", getattr(d, bound),
                        f"workload.{part}.dist=fixed uses only mean ({d.mean:g} tokens): set "
                        f"workload.{part}.dist=uniform (or lognormal, clipped to low..high) to "
                        "draw lengths in low..high",
                    )  # fmt: skip
            _positive(f"workload.{part}.low", d.low)
            if d.high < d.low:
                raise ConfigError(f"workload.{part}.high", d.high, f"must be >= low={d.low}")
    else:
        if not w.path:
            raise ConfigError("workload.path", w.path, "a trace workload needs a CSV path")
        _at_least_zero("workload.limit", w.limit, " (0 keeps every row)")
        _positive("workload.time_scale", w.time_scale)
        _positive("workload.length_scale", w.length_scale)
        _at_least_zero("workload.output_scale", w.output_scale, " (0: length_scale)")
    _at_least_zero("output.checkpoint_every", cfg.output.checkpoint_every, " (0: off)")
    resolve_auto(cfg)
    if (cfg.output.checkpoint_every or cfg.resume) and e.loop != "host":
        raise ConfigError("engine.loop", e.loop, "checkpoints and resume need the host loop")
    _one_of("engine.backend", e.backend, BACKENDS)
    _positive("engine.num_slots", e.num_slots)
    if not str(e.compile_cache).strip():  # Path("") is the working directory: a repo filled
        raise ConfigError(
            "engine.compile_cache", e.compile_cache, "user (the default), off, or a folder"
        )
    _one_of("engine.clock", e.clock, CLOCKS)
    if e.backend == "simulator" and e.clock == "measured":
        raise ConfigError(
            "engine.clock", e.clock, "the simulator has no wall time: use passes or priced"
        )
    _hardware(cfg)
    _at_least_zero("engine.temperature", e.temperature, " (0 is greedy)")
    if not 0 <= e.top_k <= m.vocab_size:
        raise ConfigError("engine.top_k", e.top_k, f"must be in 0..{m.vocab_size} (0: no top-k)")
    if not -1 <= m.eos_id < m.vocab_size:
        raise ConfigError(
            "model.eos_id", m.eos_id, f"must be -1 (none) or in 0..{m.vocab_size - 1}"
        )
    if not -1 <= e.eos_id < m.vocab_size:
        raise ConfigError(
            "engine.eos_id", e.eos_id,
            f"must be -1 (the model's EOS) or a token id in 0..{m.vocab_size - 1} "
            "(model.vocab_size)",
        )  # fmt: skip
    if e.min_bucket < 1 or e.min_bucket & (e.min_bucket - 1):
        raise ConfigError(
            "engine.min_bucket", e.min_bucket, "must be a power of two (1, 2, 4, ...)"
        )
    if e.loop == "fused":
        raise ConfigError(
            "engine.loop", e.loop, "the fused loop is now loop=device: use host or device"
        )
    _one_of("engine.loop", e.loop, LOOPS)
    _one_of("engine.decode_rows", e.decode_rows, DECODE_ROWS)
    if e.loop == "device" and e.backend == "runner":
        if e.clock == "measured" and (w.kind != "synthetic" or w.arrival != "offline"):
            raise ConfigError(
                "engine.loop", e.loop,
                "with engine.clock=measured needs an offline workload (workload.kind=synthetic, "
                "workload.arrival=offline): the loop is timed as a whole, so it cannot wait for "
                "an arrival; use engine.clock=passes, or loop=host",
            )  # fmt: skip
    mem = cfg.memory
    _one_of("memory.layout", mem.layout, ("contiguous", "paged"))
    _one_of("memory.reservation", mem.reservation, ("max_len", "pow2", "exact"))
    _positive("memory.block_size", mem.block_size)
    if m.max_len % mem.block_size:
        raise ConfigError(
            "memory.block_size", mem.block_size, f"must divide model.max_len={m.max_len}"
        )
    _at_least_zero("memory.budget_mib", mem.budget_mib, " (0: one max_len per slot)")
    _at_least_zero("memory.budget_tokens", mem.budget_tokens)
    if not 0 <= mem.watermark < 1:
        raise ConfigError("memory.watermark", mem.watermark, "must be in [0, 1)")
    _mesh(cfg)
    if e.backend == "simulator" and cfg.output.tokens:
        raise ConfigError(
            "output.tokens", cfg.output.tokens,
            "the simulator runs no model, so it has no tokens to write: use engine.backend=runner "
            "or output.tokens=false",
        )  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mesh(cfg: Config) -> None:
    """A mesh the model and slots split over: the model axis must divide the KV heads (each
    device holds whole heads), the heads and the MLP; the data axis the slots (slot layout)."""
    mesh, m, e = cfg.mesh, cfg.model, cfg.engine
    _positive("mesh.data", mesh.data)
    _positive("mesh.model", mesh.model)
    if mesh.data * mesh.model == 1:
        return
    if e.backend != "runner":
        raise ConfigError(
            "mesh.model", mesh.model,
            "a mesh runs the model: needs engine.backend=runner (the simulator prices "
            "hardware.tensor_parallel)",
        )  # fmt: skip
    for size, what in ((m.n_kv_heads, "n_kv_heads"), (m.n_heads, "n_heads"), (m.d_mlp, "d_mlp")):
        if size % mesh.model:
            valid = [d for d in range(1, m.n_kv_heads + 1)
                     if not (m.n_kv_heads % d or m.n_heads % d or m.d_mlp % d)]  # fmt: skip
            raise ConfigError(
                "mesh.model", mesh.model,
                f"must divide model.{what}={size}: valid model axes are {valid}",
            )  # fmt: skip
    if cfg.memory.layout == "contiguous" and e.num_slots % mesh.data:
        raise ConfigError(
            "mesh.data", mesh.data,
            f"must divide engine.num_slots={e.num_slots} (the slot layout splits slots): one of "
            f"{_divisors(e.num_slots)}",
        )  # fmt: skip
    import jax  # only a mesh asks how many devices there are

    if mesh.data * mesh.model > jax.device_count():
        raise ConfigError(
            "mesh.data", mesh.data,
            f"a {mesh.data}x{mesh.model} mesh needs {mesh.data * mesh.model} devices; "
            f"{jax.device_count()} visible",
        )  # fmt: skip


def _hardware(cfg: Config) -> None:
    h, e, m = cfg.hardware, cfg.engine, cfg.model
    _one_of("hardware.name", h.name, HARDWARE_NAMES)
    if e.clock == "priced":
        if e.backend != "simulator":
            raise ConfigError(
                "engine.clock", e.clock, "prices passes: needs engine.backend=simulator"
            )
        if h.name == "none":
            raise ConfigError(
                "hardware.name", h.name,
                "engine.clock=priced (the simulator's default) needs hardware to price passes "
                "for: use one of " + ", ".join(HARDWARE_NAMES[1:])
                + "; or engine.clock=passes, which counts passes",
            )  # fmt: skip
    if h.name == "none":
        return
    for name in ("peak_tflops", "memory_gb_s", "memory_gb", "link_gb_s", "compute_efficiency",
                 "memory_efficiency", "attention_efficiency", "tensor_parallel"):  # fmt: skip
        _positive(f"hardware.{name}", getattr(h, name))
    if not 0.0 <= h.overlap <= 1.0:
        raise ConfigError(
            "hardware.overlap", h.overlap,
            "must be in [0, 1]: the share of an operation's shorter time (compute or memory) that "
            "the longer hides (1: the roofline's max, 0: their sum)",
        )  # fmt: skip
    extras = {"pass": 0.0, "prefill": h.prefill_overhead_us, "mixed": h.mixed_overhead_us}
    for kind, extra in extras.items():  # each kind's whole overhead is a time: never below 0
        if not h.pass_overhead_us + extra >= 0:
            field, named = f"{kind}_overhead_us", "" if kind == "pass" else f"{kind} "
            total = "pass_overhead_us" + ("" if kind == "pass" else f" + {field}")
            raise ConfigError(
                f"hardware.{field}",
                getattr(h, field),
                f"a {named}pass's overhead ({total}) must be >= 0",
            )
    if m.n_kv_heads % h.tensor_parallel:
        raise ConfigError(
            "hardware.tensor_parallel", h.tensor_parallel,
            f"must divide model.n_kv_heads={m.n_kv_heads} (and n_heads={m.n_heads}): each device "
            "holds whole heads",
        )  # fmt: skip


def register() -> None:
    """The schema, and `${jaxbatch_checkout:}`: the checkout's folder, so that a shipped config can
    name a file beside it (the traces in ../shared/traces) whatever folder a run starts in."""
    ConfigStore.instance().store(name="jaxbatch_schema", node=Config)
    OmegaConf.register_new_resolver("jaxbatch_checkout", lambda: str(CHECKOUT), replace=True)
