"""The typed run configuration: one frozen dataclass per config group.

Every key has a type and a default here. Hydra composes YAML onto these classes
(registered as structured configs), so an unknown key or a wrong type fails at
compose time with the key's full path. The worker loads `RUN_DIR/config.yaml`
back into the same classes with `load.load_run_config` (config/load.py holds the
OmegaConf side: the structured schema node, `from_dict`, `to_yaml`).

This module is imported on both sides of the wall: it must stay free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainctl.config.cluster_schema import (  # noqa: F401  (re-exported: the schema's one face)
    DEFAULT_STOP_SIGNAL,
    DEVICES,
    ClusterConfig,
    cluster_configs,
    launchers,
    register_cluster,
    unregister_cluster,
)
from trainctl.config.fields import at_least, at_most, choice, positive, within
from trainctl.config.schema_ramp import BatchRampConfig
from trainctl.core import objectives, optimizers, schedules, wrapping
from trainctl.core.float8 import FP8_FILTERS
from trainctl.core.nf4 import BASE_DTYPES

# Allowed values of the string-valued choices that no registry lists (the fields below declare theirs).
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = schedules.names()
OPTIMIZERS = optimizers.names()
DATA_KINDS = ("stdlib", "memmap", "synthetic", "hf")
TOKEN_DTYPES = ("uint16", "uint32")
AC_MODES = ("none", "full", "selective", "op")
ATTENTION_KERNELS = ("cudnn", "flash")  # the SDPA kernel tried first on CUDA
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")
WANDB_MODES = ("online", "offline", "disabled")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
LOAD_ONLY = ("all", "model", "model_optim")
NONFINITE_POLICIES = ("stop", "skip")
SPIKE_POLICIES = ("off", "warn", "skip")
REDUCE_DTYPES = ("fp32", "bf16")
# Qwen3-MoE: softmax over all experts, then top-k; Mixtral: top-k, then softmax over the k
ROUTERS = ("softmax_topk", "topk_softmax")

# The worker seeds numpy's global generator with train.seed (np.random.seed takes 0 .. 2**32 - 1).
MAX_SEED = 2**32 - 1
SEED_MESSAGE = f"must be an integer in [0, {MAX_SEED}] (numpy's seed range); e.g. train.seed=1234"

# Choices and ranges are declared on their fields (below) with config/fields.py's helpers; validate checks every
# declared field generically. A registry's names are its field's choices: pass the function that lists them.


def _families() -> tuple[str, ...]:
    from trainctl.models import registry

    return registry.names()


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the decoder's projections (rank 0: off, every weight trains)."""

    rank: int = 0  # r of every adapter; 0: no LoRA
    alpha: float = 16.0  # the update is scaled by alpha / rank (peft's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input (peft's lora_dropout)
    # any of q, k, v, o, gate, up, down; on a mixture of experts expert_gate_up, expert_down (one adapter per expert)
    targets: list[str] = field(default_factory=lambda: ["q", "k", "v", "o"])
    # the adapted projections' frozen weights: fp32 (the master weights), or nf4 (QLoRA: torchao's 4-bit NF4)
    base_dtype: str = choice("fp32", BASE_DTYPES)


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: every block's MLP is `num_experts` SwiGLU experts of which a router picks
    `experts_per_token` per token (0 experts: a dense model, the default)."""

    num_experts: int = at_least(0, 0, message="must be 0 (a dense model) or the number of routed experts")
    experts_per_token: int = positive(2)  # top-k
    expert_ffn_dim: int = positive(704)  # each routed expert's SwiGLU hidden size
    shared_expert_ffn_dim: int = at_least(0, 0)  # 0: no shared expert
    router: str = choice("softmax_topk", ROUTERS)
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1 (softmax_topk)
    aux_loss_coef: float = at_least(0.001, 0)  # load-balancing loss weight (Switch / Mixtral form); 0: off
    # 0: no token dropped (default); else each expert takes at most capacity_factor * tokens * k / experts tokens
    capacity_factor: float = at_least(0.0, 0)
    # > 0: auxiliary-loss-free balancing (a per-expert routing bias nudged by this rate toward even load)
    bias_update_rate: float = at_least(0.0, 0)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. `family` picks trainctl/models/<family>/ (its spec, module and parallel plan); the
    family-specific keys below default to plain Llama (full attention, plain RoPE, head_dim = dim / n_heads)."""

    name: str = "tiny"
    # llama | qwen2 | qwen3 | mistral | qwen3_moe | mixtral (the folders of trainctl/models with a spec.py)
    family: str = choice("llama", _families, "unknown family; choose one of")
    dim: int = positive(256)
    n_layers: int = positive(4)
    n_heads: int = positive(8)
    n_kv_heads: int = positive(4)
    ffn_dim: int = positive(704)  # SwiGLU hidden size (w1/w3 output, w2 input)
    vocab_size: int = positive(256)
    max_seq_len: int = positive(1024)
    norm_eps: float = positive(1e-5)
    rope_theta: float = positive(10000.0)
    tie_embeddings: bool = False
    # per-head size of q, k, v; 0: dim // n_heads (Qwen3 0.6B sets 128 with dim 1024, 16 heads)
    head_dim: int = at_least(0, 0, message="must be 0 (the default) or positive")
    rope_scaling: str = "none"  # none | linear | llama3 (Llama 3.1 / 3.2)
    rope_factor: float = 1.0  # linear and llama3: positions (llama3: low frequencies) are stretched by it
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original/low are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are not scaled
    rope_original_max_seq_len: int = positive(8192)  # llama3: the context the model was first trained with
    # 0: full attention; else refused unless it covers train.seq_len
    sliding_window: int = at_least(0, 0, message="must be 0 (the default) or positive")
    path: str = ""  # a Hugging Face folder or Hub name (org/name) whose config.json gives the family and shape
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision: compute dtype under autocast; master weights stay fp32."""

    compute_dtype: str = choice("fp32", PRECISIONS)  # fp32 | bf16 | fp16
    reduce_dtype: str = choice("fp32", REDUCE_DTYPES)  # gradient reduction dtype
    fp8: bool = False  # torchao float8 linear layers on top of bf16
    fp8_recipe: str = choice("tensorwise", FP8_RECIPES)
    # auto: only the Linears torchao's size rule says gain for the recipe; all: every 16-aligned one (core/float8.py)
    fp8_filter: str = choice("auto", FP8_FILTERS)
    # Linear layers whose name contains one of these stay in bf16 (the output layer is
    # sensitive; torchao also skips layers whose dims are not multiples of 16).
    fp8_exclude: list[str] = field(default_factory=lambda: ["output"])
    loss_scaling: bool = False  # dynamic loss scaling (required for fp16)
    init_scale: float = positive(65536.0)  # first loss scale of the dynamic scaler


@dataclass(frozen=True)
class ShardingConfig:
    """Data / model parallel layout. -1 means: infer from the world size.

    With pipeline parallelism each of the step's `train.grad_accum` micro-batches is one
    pipeline microbatch: the schedule runs grad_accum of them per optimizer step.
    """

    strategy: str = choice("none", wrapping.STRATEGIES)  # none | ddp | zero1 | zero2 | zero3 | fsdp | hsdp
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # expert parallelism: each MoE layer's experts split over ep ranks carved from the data-parallel ranks
    ep: int = 1
    pp_schedule: str = choice("1f1b", PP_SCHEDULES)  # gpipe | 1f1b | interleaved_1f1b | interleaved_zero_bubble
    pp_stages_per_rank: int = at_least(1, 1)  # >1 for the interleaved schedules (virtual stages)
    pp_layers: list[int] = field(default_factory=list)  # layers per stage, in order; []: split evenly
    cpu_offload: bool = False  # FSDP2 offload of parameters, gradients and optimizer states to CPU


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then the named decay."""

    name: str = choice("cosine", schedules.names)  # constant | linear | cosine | wsd
    warmup_steps: int = at_least(10, 0)
    min_lr_ratio: float = within(0.1, 0, 1)  # floor of the decay, as a fraction of optim.lr
    decay_fraction: float = within(0.2, 0, 1, open_low=True)  # wsd only: share of the steps spent decaying


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer `name` picks (core/optimizers.py); weight decay never applies to norms and biases."""

    name: str = choice("adamw", optimizers.names)
    lr: float = positive(3e-4)
    beta1: float = within(0.9, 0, 0.999999, open_low=True)  # adamw, lion, adamw8bit/4bit/fp8, muon (its AdamW part)
    beta2: float = within(0.95, 0, 0.999999, open_low=True)  # as beta1; lion's moment decay
    eps: float = positive(1e-8)  # the Adam family and muon's AdamW part
    weight_decay: float = at_least(0.1, 0)
    grad_clip: float = at_least(1.0, 0, "0 disables clipping")  # global-norm clipping; 0 disables
    beta2_decay: float = at_most(-0.8, 0)  # adafactor only: its second-moment decay 1 - step^beta2_decay (<= 0)
    momentum: float = within(0.9, 0, 0.999999)  # sgd (0: plain SGD, no state) and muon
    nesterov: bool = False  # sgd and muon: Nesterov momentum
    # muon only: torch.optim.Muon's lr scaling per matrix (A x B): original lr x sqrt(max(1, A/B)), or
    # match_rms_adamw lr x 0.2 x sqrt(max(A, B)) so that one optim.lr suits the Muon and the AdamW parameters
    muon_adjust_lr: str = choice("match_rms_adamw", ("original", "match_rms_adamw"))


@dataclass(frozen=True)
class DataConfig:
    """Token source. Byte-level tokens for the embedded corpus."""

    kind: str = choice("stdlib", DATA_KINDS)  # stdlib | memmap | synthetic | hf
    train_path: str = ""  # memmap: pre-tokenized token file
    val_path: str = ""  # memmap: held-out token file
    token_dtype: str = choice("uint16", TOKEN_DTYPES)  # memmap: uint16 | uint32
    # memmap: prepared datasets (`trainctl data prepare`), all their shards; instead of train_path/val_path
    datasets: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # blend weights of `datasets` (default: by their tokens)
    # largest token id + 1 the data can contain; 0: the model's vocab_size
    vocab_size: int = at_least(256, 0, "0 means the model's vocab_size")
    # Packed documents attend only to themselves, RoPE restarting at each (needs datasets with document starts)
    document_mask: bool = False
    val_fraction: float = within(0.05, 0, 0.5, open_low=True)  # stdlib: share of files held out
    cache_dir: str = "~/.cache/trainctl"
    # hf: a Hugging Face dataset tokenized on the fly: a Hub name (through the datasets cache), a save_to_disk
    # folder, or a .parquet/.arrow/.json/.jsonl/.csv file or folder of them
    source: str = ""
    hf_config: str = ""  # hf: the dataset's configuration (subset) name; "": its default
    split: str = "train"  # hf: the split trained on
    val_split: str = ""  # hf: the held-out split evaluated on; "": none (needs train.eval_every=0)
    text_field: str = ""  # hf: the field holding each document's text; "": text (unless a chat field is named)
    # hf: a field of chat rows (a list of {role, content}), rendered by the tokenizer's chat template; only the
    # assistant's tokens count in the loss, as in `data prepare --format chat`
    messages_field: str = ""
    prompt_field: str = ""  # hf: instruction rows' prompt field (with completion_field); it does not count in the loss
    completion_field: str = ""  # hf: instruction rows' answer field (with prompt_field); it and its EOS count
    streaming: bool = False  # hf: read rows as they are needed (nothing downloaded or converted whole)
    tokenizer: str = ""  # hf: a tokenizer.json (or its folder), or bytes; "": the model's (model.path, init_from)


@dataclass(frozen=True)
class TrainConfig:
    """The loop: steps, batch math, memory options, evaluation cadence."""

    steps: int = positive(100)
    seq_len: int = positive(256)
    global_batch: int = -1  # sequences per optimizer step; -1: micro_batch x grad_accum x dp
    micro_batch: int = 1  # sequences per rank per forward; -1: derive
    grad_accum: int = 1  # micro-batches per optimizer step; -1: derive
    seed: int = within(0, 0, MAX_SEED, message=SEED_MESSAGE)
    # none | full | selective (every k-th block) | op (per-op: keep matmuls)
    activation_checkpointing: str = choice("none", AC_MODES)
    ac_every: int = at_least(2, 1)  # selective: checkpoint every k-th block
    activation_offload: bool = False  # keep saved activations in CPU memory until backward
    compile: bool = False
    # cudnn | flash: the SDPA kernel tried first on CUDA (flash: never cuDNN)
    attention: str = choice("cudnn", ATTENTION_KERNELS)
    # also at step 0 and the last step; 0: no evaluation at all
    eval_every: int = at_least(50, 0, "0 disables evaluation")
    eval_batches: int = 8
    # Python's garbage collector runs every N steps on every rank at once; 0: whenever it likes
    gc_every: int = at_least(50, 0, "0 leaves Python's garbage collector alone")
    # a rank with no step, eval or save finished for this long dumps its stacks and exits (a restart follows,
    # cluster.max_restarts); 0: no watchdog. At most 30 days: the watchdog's timer (faulthandler) overflows
    # somewhere past 1e9 s, depending on the platform, and a month without progress is a hang on any cluster
    hang_timeout_s: float = within(1800.0, 0, 2_592_000.0, message="must be 0 (no hang watchdog) or 1 to 2592000 "
                                   "seconds (30 days), a few times the slowest step or save")
    # sft | dpo | simpo (core/objectives.py); dpo and simpo train on preference pairs (data prepare --format
    # preference), global_batch and micro_batch then count pairs
    objective: str = choice("sft", objectives.OBJECTIVES)
    dpo_beta: float = positive(0.1)  # dpo: how far the policy may move from the reference (the KL weight)
    # dpo: the assumed share of pairs whose preference is flipped (conservative DPO; 0: plain DPO)
    dpo_label_smoothing: float = within(0.0, 0, 0.5, message="must be in [0, 0.5]: the assumed share of "
                                        "pairs whose labels are flipped (0: plain DPO)")
    simpo_beta: float = positive(2.0)  # simpo: the scale of the length-normalized reward
    simpo_gamma: float = at_least(0.5, 0)  # simpo: the target reward margin

    # grow the global batch over the first steps; the lr schedule then runs on tokens (core/batch_ramp.py)
    batch_ramp: BatchRampConfig = field(default_factory=BatchRampConfig)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one full optimizer step trains on (global_batch resolved: validate fills in -1); a preference pair
        is two sequences (core/objectives.py); a batch ramp's early steps train fewer."""
        return self.global_batch * self.seq_len * objectives.cost(self.objective, False).sequences_per_sample


@dataclass(frozen=True)
class CheckpointConfig:
    """Distributed checkpoints under RUN_DIR/checkpoints/step-NNNNNNNN, committed atomically."""

    # save every N optimizer steps; 0: only at the end and on a stop request
    every: int = at_least(0, 0, "0 saves only at the end and on a stop request")
    # committed checkpoints kept (>= 2); older ones pruned after a newer commit
    keep_last: int = at_least(2, 2, "the newest checkpoint may be damaged; keep one to fall back on")
    save_final: bool = True  # save after the last step
    async_save: bool = False  # write in the background while the loop continues
    resume: str = "auto"  # auto: newest valid checkpoint of this run | never | a checkpoint or run directory
    load_only: str = choice("all", LOAD_ONLY)  # resume from a path: all | model | model_optim (a fresh run otherwise)
    init_from: str = ""  # a Hugging Face model folder or Hub name: its weights start a fresh run (a resume ignores it)


@dataclass(frozen=True)
class GuardsConfig:
    """What the loop does with bad numbers, agreed across ranks before the optimizer step."""

    nonfinite: str = choice("stop", NONFINITE_POLICIES)  # stop | skip: a non-finite loss or gradient norm
    max_consecutive_skips: int = at_least(3, 1)  # skip: stop after this many skipped steps in a row
    spike: str = choice("off", SPIKE_POLICIES)  # off | warn | skip: loss-spike detector (robust z-score over a window)
    # steps of loss history for the median and MAD
    spike_window: int = at_least(50, 5, "the median and MAD need a few steps of history")
    spike_zscore: float = positive(6.0)  # a loss this many robust deviations above the median is a spike


@dataclass(frozen=True)
class WandbConfig:
    mode: str = choice("disabled", WANDB_MODES)  # online | offline | disabled
    project: str = "trainctl"
    entity: str = ""
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LoggingConfig:
    log_every: int = positive(10)
    progress: bool = True
    tensorboard: bool = True  # event files under RUN_DIR/tensorboard when the tensorboard package is installed
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(frozen=True)
class RunConfig:
    """The whole, composed configuration of one run."""

    name: str = ""  # run directory name under runs_dir; "" -> <recipe or model>-<timestamp>
    recipe: str = ""  # set by the recipe file that was chosen, for the record
    description: str = ""
    runs_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)


GROUPS = ("model", "precision", "sharding", "schedule", "optim", "cluster", "data")

# The one key that names each group's option (`sharding=zero3` sets sharding.strategy=zero3).
OPTION_KEY = {
    "model": "name",
    "precision": "compute_dtype",
    "sharding": "strategy",
    "schedule": "name",
    "optim": "name",
    "cluster": "launcher",
    "data": "kind",
}


def option_of(group: str, node) -> str:
    """The option a group's config stands for: its option key, except that fp8 is bf16 with float8 layers."""
    if group == "precision" and node.fp8:
        return "fp8"
    return str(getattr(node, OPTION_KEY[group]))

