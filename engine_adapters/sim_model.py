"""The `sim` engine's timing model of continuous batching (no asyncio, no clock), its
vocabulary and its parameters. `engine_adapters/sim.py` drives it on the wall clock.

A deterministic timing model of a continuous-batching engine.

Two parts share one model:

* `SimTimingModel` — plain, clockless, no asyncio. It owns an engine-internal FCFS waiting queue
  and a running set, as vLLM's scheduler does; `step()` runs one engine step and says how long it
  took. A discrete-event simulator calls `step()` and schedules the next one at `now + duration`.
* `SimEngine` — an `EngineClient` that drives the same model on the wall clock inside the server.

The model, one step at a time (`SimConfig` holds every parameter):

1. Token budget `max_batched_tokens`. Running sequences are visited in the order they started.
   A sequence whose tokens are not all computed yet (a prompt, or a preempted sequence being
   recomputed) gets a prefill chunk of `min(remaining, budget)` tokens — chunked prefill, so a
   long prompt spans several steps; a sequence in decode gets its 1 token.
2. KV cache: `kv_blocks` blocks of `block_size` tokens. A sequence holds
   `ceil(computed_tokens / block_size)` blocks, i.e. `ceil((prompt + generated) / block_size)`
   once it decodes. Blocks for a chunk are taken before it runs. When none is free, the most
   recently started running sequence is preempted: its blocks are freed, it goes back to the
   front of the waiting queue, and when readmitted it recomputes prompt + generated tokens as
   prefill (vLLM's recompute preemption). A sequence never preempts one started before it.
3. If nothing was preempted this step, waiting sequences are admitted in FCFS order while
   `len(running) < max_num_seqs`, budget is left and the blocks for their first chunk fit; the
   first that does not fit blocks the ones behind it. A sequence on a LoRA adapter needs a slot
   (`max_loras` of them): its adapter's, where a running sequence holds it, or a free one.
   Without, it is passed over and stays first, and the ones behind it go on (vLLM's). An
   adapter that takes a slot another last held (or an empty one) is loaded into it:
   `lora_load_ms` more on that step. Slots go least recently used first.
   Prefix caching (as vLLM's, on by default): every full block a sequence computes is kept,
   addressed by its content (the hash chain of its tokens), in an LRU of up to `kv_blocks`
   blocks that outlives the sequence. A sequence admitted with computed = 0 (new, resumed, or
   recomputing after preemption) starts from its longest cached prefix of whole blocks, and
   computes at least its last token.
4. Every sequence whose tokens are all computed after the step samples one new token. It
   finishes with "length" at `max_tokens` generated or `max_model_len` total tokens, otherwise
   with "stop" with probability `eos_probability` once it has `min_tokens` (and never with
   `ignore_eos`). Finished sequences free their blocks at the end of the step.
5. Step duration = the decode part + `prefill_ms_per_token * prefill_tokens` (recomputed
   tokens count as prefill), times `lora_step_factor` when any running sequence is on a LoRA
   adapter (a step that runs an adapter's sequence computes its low-rank products too: on
   vLLM's CPU build, the demo model's adapters make a step about twice the base model's),
   plus the adapters it loads. The decode part follows one of three step curves: linear, a CPU's
   (`step_base_ms + decode_ms_per_token * decode_tokens`); flat up to a knee, a GPU's (the
   same, less `decode_knee_tokens` tokens at no cost); or read from a calibration
   (`step_curve_ms`: the step time at several decode batch sizes, interpolated between them
   and extended along the last segment beyond them).

Tokens come from a per-request `random.Random` seeded by `seed`, or by a stable hash of the
request id, and one token is drawn per step regardless of batching: the same request yields the
same tokens under any load or config; only timing changes. A model made with
`report_tokens=False` (a simulator that only counts tokens) reports none, and a sequence that no
draw can end (`ignore_eos`, or no end-of-sequence probability) draws its tokens only when the
model reads them (to cache a full block, to recompute, or for `token_ids`): from the same
stream, so its tokens and the schedule are the same either way. Token ids map onto a fixed list of
common English words, so text reads as words. `SimConfig.__post_init__` requires that one
sequence of `max_model_len` tokens fits the KV pool (as vLLM does at startup), so the model
always makes progress.
"""

from __future__ import annotations

import _random
import argparse
import bisect
import hashlib
import itertools
import logging
import re
import sys
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from engine_adapters.protocol import EngineLimits, KVCacheInfo, ModelInfo

_log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- vocabulary

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
BOS_ID, EOS_ID = 0, 1
ROLE_IDS = {"system": 3, "user": 4, "assistant": 5}

WORDS: tuple[str, ...] = tuple(
    """
    the of and to a in is it you that he was for on are with as his they be at one have this
    from or had by word but what some we can out other were all there when up use your how said
    an each she which do their time if will way about many then them write would like so these
    her long make thing see him two has look more day could go come did number sound no most
    people my over know water than call first who may down side been now find any new work part
    take get place made live where after back little only round man year came show every good me
    give our under name very through just form sentence great think say help low line differ turn
    cause much mean before move right boy old too same tell does set three want air well also
    play small end put home read hand port large spell add even land here must big high such
    follow act why ask men change went light kind off need house picture try us again animal point
    mother world near build self earth father head stand own page should country found answer
    school grow study still learn plant cover food sun four between state keep eye never last let
    thought city tree cross farm hard start might story saw far sea draw left late run while press
    close night real life few north open seem together next white children begin got walk example
    ease paper group always music those both mark often letter until mile river car feet care
    second book carry took science eat room friend began idea fish mountain stop once base hear
    horse cut sure watch color face wood main enough plain girl usual young ready above ever red
    list though feel talk bird soon body dog family direct pose leave song measure door product
    black short numeral class wind question happen complete ship area half rock order fire south
    problem piece told knew pass since top whole king space heard best hour better true during
    hundred five remember step early hold west ground interest reach fast verb sing listen six
    table travel less morning ten simple several vowel toward war lay against pattern slow center
    love person money serve appear road map rain rule govern pull cold notice voice unit power
    town fine certain fly fall lead cry dark machine note wait plan figure star box noun field
    rest correct able pound done beauty drive stood contain front teach week final gave green
    quick develop ocean warm free minute strong special mind behind clear tail produce fact
    """.split()
)
WORD_IDS = {word: len(SPECIAL_TOKENS) + i for i, word in enumerate(WORDS)}
TOKEN_PATTERN = re.compile(r"<\|[a-z]+\|>|[A-Za-z0-9']+|[^\sA-Za-z0-9']")


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def token_text(token_id: int) -> str:
    """The text of one token: a space and a word; special tokens have none."""
    if token_id < len(SPECIAL_TOKENS):
        return ""
    return " " + WORDS[(token_id - len(SPECIAL_TOKENS)) % len(WORDS)]


def detokenize(token_ids: Sequence[int]) -> str:
    return "".join(token_text(t) for t in token_ids)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Parameters of the timing model.

    Defaults are a first guess to be tuned against the demo model on vLLM CPU here: a decode
    step of 32 sequences takes 1.8 + 32 x 0.1 = 5 ms (~6,400 tokens/s aggregate), prefill
    costs 0.02 ms per prompt token; `max_num_seqs`, `max_batched_tokens` and `block_size` are
    vLLM's CPU defaults, `max_model_len` and `vocab_size` the demo model's.
    """

    step_base_ms: float = 1.8
    decode_ms_per_token: float = 0.1
    prefill_ms_per_token: float = 0.02
    max_num_seqs: int = 128
    max_batched_tokens: int = 2048
    kv_blocks: int = 512
    block_size: int = 128
    max_model_len: int = 2048
    vocab_size: int = 2048
    eos_probability: float = 0.0
    prefix_caching: bool = True
    decode_knee_tokens: int = 0  # decode tokens of a step that cost nothing beyond its base
    # (decode tokens, step ms) points, rising: the step curve as a calibration read it; when set,
    # it replaces `step_base_ms`, `decode_ms_per_token` and `decode_knee_tokens`.
    step_curve_ms: tuple[tuple[int, float], ...] = ()
    # On the wall clock (`SimEngine`) only: steps run back to back, at most, when the server's
    # loop fell behind the engine's clock. 0: the engine waits for the loop.
    catch_up_steps: int = 0
    max_loras: int = 0  # LoRA slots: the most distinct adapters one step runs (0: serves none)
    lora_load_ms: float = 0.0  # loading an adapter into a slot, added to the step that does
    lora_step_factor: float = 1.0  # a step that runs any adapter's sequence costs this more

    def __post_init__(self) -> None:
        if min(self.step_base_ms, self.decode_ms_per_token, self.prefill_ms_per_token) < 0:
            raise ValueError("step costs must be >= 0")
        if min(self.max_num_seqs, self.kv_blocks, self.block_size, self.max_model_len) < 1:
            raise ValueError("max_num_seqs, kv_blocks, block_size, max_model_len must be >= 1")
        if self.max_batched_tokens < self.max_num_seqs:
            raise ValueError("max_batched_tokens must be >= max_num_seqs")
        if self.kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"KV pool of {self.kv_blocks * self.block_size} tokens cannot hold one sequence "
                f"of max_model_len={self.max_model_len}"
            )
        if self.vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must be > {len(SPECIAL_TOKENS)}")
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError("eos_probability must be in [0, 1]")
        if self.catch_up_steps < 0:
            raise ValueError("catch_up_steps must be >= 0")
        if self.max_loras < 0 or self.lora_load_ms < 0:
            raise ValueError("max_loras and lora_load_ms must be >= 0")
        if self.lora_step_factor < 1:
            raise ValueError("lora_step_factor must be >= 1")
        if self.decode_knee_tokens < 0:
            raise ValueError("decode_knee_tokens must be >= 0")
        curve = self.step_curve_ms
        if curve and (
            any(n < 1 or ms <= 0 for n, ms in curve)
            or any(b[0] <= a[0] or b[1] < a[1] for a, b in itertools.pairwise(curve))
        ):
            raise ValueError(
                "step_curve_ms must be points (decode tokens >= 1, ms > 0) rising in both"
            )

    def decode_ms(self, decode_tokens: int) -> float:
        """The decode part of a step that decodes `decode_tokens` (a step with no decode
        token, only prefill, costs what one decode token's does)."""
        curve = self.step_curve_ms
        if curve:
            return _interpolate(curve, decode_tokens if decode_tokens > 1 else 1)
        beyond_knee = decode_tokens - self.decode_knee_tokens
        return self.step_base_ms + self.decode_ms_per_token * (
            beyond_knee if beyond_knee > 0 else 0
        )

    @staticmethod
    def parse_curve(text: str) -> tuple[tuple[int, float], ...]:
        """`1:2.5,8:6.4,...` (decode tokens: step ms), or a calibration's log line as the
        server writes it: `1: 2.5 ms, 2: 3.2 ms, ...`."""
        points = []
        for item in text.replace("ms", "").split(","):
            if item.strip():
                n, _, ms = item.partition(":")
                points.append((int(n), float(ms)))
        return tuple(points)

    def model_info(self, name: str, adapters: Mapping[str, str] | None = None) -> ModelInfo:
        """The `sim` engine's model info, serving `adapters` (name to path): the server's
        engine and the discrete-event simulator both plan with this one."""
        return ModelInfo(
            name=name,
            path=name,
            max_model_len=self.max_model_len,
            limits=EngineLimits(
                max_num_seqs=self.max_num_seqs,
                max_batched_tokens=self.max_batched_tokens,
                kv_cache=KVCacheInfo(block_size=self.block_size, num_blocks=self.kv_blocks),
                adapter_slots=self.max_loras,
            ),
            vocab_size=self.vocab_size,
            engine="sim",
            beam_search=False,
            adapters={} if adapters is None else adapters,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SimConfig:
        values = {
            f.name: getattr(args, f"sim_{f.name}")
            for f in fields(cls)
            if getattr(args, f"sim_{f.name}", None) is not None
        }
        return cls(**values)


_ARG_HELP = {
    "step_base_ms": "fixed cost of one engine step, in ms",
    "decode_ms_per_token": "cost per decode token in a step, in ms",
    "prefill_ms_per_token": "cost per prompt (or recomputed) token prefilled in a step, in ms",
    "max_num_seqs": "most sequences running in one step",
    "max_batched_tokens": "token budget of one step; longer prompts are prefilled in chunks",
    "kv_blocks": "KV cache blocks; a sequence holds ceil(tokens / block size) of them",
    "block_size": "tokens per KV cache block",
    "max_model_len": "longest sequence, prompt plus output, in tokens",
    "eos_probability": "chance per generated token of finishing with 'stop'",
    "decode_knee_tokens": "decode tokens a step takes at no cost beyond its base (a GPU's flat "
    "part; 0: every token costs, a CPU's line)",
    "step_curve_ms": "the step curve read from a calibration, 'decode tokens:ms,...' (or the "
    "server's log line '1: 2.5 ms, 2: 3.2 ms, ...'); replaces the base, per-token and knee costs",
    "lora_load_ms": "cost of loading an adapter into a slot, added to the step that loads it",
    "lora_step_factor": "a step that runs any LoRA adapter's sequence costs this many times "
    "the base model's (1: no more)",
    "catch_up_steps": "when the server's loop falls behind the engine's clock, run up to N "
    "steps back to back, their tokens reaching each stream as one delta, as an engine in a "
    "process of its own runs on (0: the engine waits for the loop)",
}


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `--sim-*` options (used with `--engine sim`); read them with `from_args`."""
    group = parser.add_argument_group("sim engine (--engine sim)")
    for f in fields(SimConfig):
        if f.name not in _ARG_HELP:
            continue
        group.add_argument(
            f"--sim-{f.name.replace('_', '-')}",
            type=SimConfig.parse_curve if f.name == "step_curve_ms" else type(f.default),
            default=f.default,
            help=_ARG_HELP[f.name],
        )


def _interpolate(points: tuple[tuple[int, float], ...], x: int) -> float:
    """The curve through `points` at `x`: flat below the first, along the last segment beyond
    the last."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    i = bisect.bisect_left(points, x, key=_first)
    (x0, y0), (x1, y1) = points[i - 1 if i < len(points) else -2], points[min(i, len(points) - 1)]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _first(point: tuple[int, float]) -> int:
    return point[0]


# --------------------------------------------------------------------------- timing model


@dataclass(slots=True)
class SequenceOutput:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int | None = None  # on a sequence's first output: its cached prefix


@dataclass(slots=True)
class StepResult:
    """One step: how long it took, and its outputs as columns. Each sequence that sampled
    samples exactly one token per step, so output i is `request_ids[i]`'s `token_ids[i]`,
    ending it if `finish_reasons[i]` is set (building an object per token cost about as much
    as sampling it; `outputs` builds them, for readers that want them). A model made with
    `report_tokens=False` leaves `token_ids` empty (and has no `outputs`). Not frozen: a
    frozen dataclass sets each of its nine fields through `object.__setattr__`, which cost
    3% of a simulation's time, one result a step; nothing changes one once returned."""

    duration_s: float
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)  # at first outputs
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preempted: tuple[str, ...] = ()
    adapters_loaded: int = 0  # adapters this step loaded into a slot

    @property
    def outputs(self) -> list[SequenceOutput]:
        cached = self.num_cached_tokens
        return [
            SequenceOutput(rid, [token], reason, cached.get(rid))
            for rid, token, reason in zip(
                self.request_ids, self.token_ids, self.finish_reasons, strict=True
            )
        ]


@dataclass(slots=True, eq=False)
class _Sequence:
    request_id: str
    tokens: list[int]
    prompt_len: int
    min_tokens: int
    ignore_eos: bool
    seed: int
    # The generator `random.Random` wraps, seeded as `random.Random(seed)` seeds it (the same
    # stream: `tests/engine_adapters/test_sim.py` checks it); its Python-level init and seed
    # checks cost a third again on top. None until its first draw: seeding one costs more than
    # all the rest of a short request's life in the model.
    rng: _random.Random | None
    draws_each_step: bool  # else its tokens are drawn when read (see the module docstring)
    stop_length: int  # it finishes with "length" at this many tokens (max_tokens, or the model's)
    length: int  # its tokens, prompt and generated; `tokens` may hold fewer, drawn so far
    computed: int = 0
    prefill_until: int = 0  # tokens below this index are prefill; set on each admission
    blocks: int = 0
    cached_blocks: int = 0  # of its full blocks, those entered in the prefix cache
    # Computed tokens at which its next block is full, to enter (never, with prefix caching
    # off): one comparison per token where a product was two.
    next_cached: int = sys.maxsize
    block_hash: int = 0  # the hash chain up to them
    cache_hit: int = 0  # prompt tokens found in the prefix cache when first admitted
    salt: int = 0  # where its hash chain starts: its cache salt's hash (0: none)
    adapter: str | None = None  # its LoRA adapter (None: the base model)

    @property
    def generated(self) -> int:
        return self.length - self.prompt_len


def _bounds(token_ids: Sequence[int]) -> tuple[int, int]:
    """The least and the greatest id; a rising range's are its ends (min() and max() walk it,
    and the simulator's prompts are ranges)."""
    if isinstance(token_ids, range) and token_ids.step > 0:
        return token_ids[0], token_ids[-1]
    return min(token_ids), max(token_ids)


def _sample(rng: _random.Random, span: int, bits: int) -> tuple[int, float]:
    """One token's draws: a word as `rng.randrange(span)` draws it (rejection sampling on
    getrandbits of the span's bit length, without its argument checks), then one
    `rng.random()` for the end-of-sequence test, drawn every token so that tokens never depend
    on the eos settings."""
    draw = rng.getrandbits(bits)
    while draw >= span:
        draw = rng.getrandbits(bits)
    return draw, rng.random()


def _draw_tokens(rng: _random.Random, count: int, first: int, span: int) -> list[int]:
    """`count` tokens, each `first` + a word drawn as `_sample` draws it (its end-of-sequence
    draw drawn and dropped), without a call per token: a sequence whose tokens are drawn only
    when read draws them here, a block at a time."""
    getrandbits, end_draw = rng.getrandbits, rng.random
    bits = span.bit_length()
    tokens = []
    for _ in range(count):
        draw = getrandbits(bits)
        while draw >= span:
            draw = getrandbits(bits)
        end_draw()
        tokens.append(first + draw)
    return tokens


class SimTimingModel:
    """Continuous batching with chunked prefill and a finite KV pool; see the module docstring."""

    def __init__(self, config: SimConfig | None = None, *, report_tokens: bool = True) -> None:
        self.config = config or SimConfig()
        self.report_tokens = report_tokens  # False: steps report no token ids
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._blocks_used = 0
        self._prefix_cache: OrderedDict[int, None] = OrderedDict()  # block hashes, LRU
        self._slots: OrderedDict[str, None] = OrderedDict()  # adapters in a slot, LRU first
        self._on_adapter: dict[str, int] = {}  # running sequences on each adapter
        self.slot_waits = 0  # times a waiting sequence was passed over for want of a slot
        # Prompt tokens of new sequences looked up in the prefix cache, and of those found
        # there (as vLLM counts them; counted at each one's first token).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def has_work(self) -> bool:
        return bool(self._by_id)

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_blocks_in_use(self) -> int:
        return self._blocks_used

    @property
    def running_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters running sequences are on."""
        return tuple(self._on_adapter)

    @property
    def waiting_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters waiting sequences are on, in their order."""
        return tuple(dict.fromkeys(s.adapter for s in self._waiting if s.adapter is not None))

    @property
    def num_deferred(self) -> int:
        """Waiting sequences that cannot start for want of a LoRA slot."""
        return sum(
            1 for s in self._waiting if s.adapter is not None and not self._has_slot(s.adapter)
        )

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        seed: int | None = None,
        cache_salt: str | None = None,
        adapter: str | None = None,
    ) -> None:
        """Queue a request at the back of the waiting queue; ValueError if it can never run.
        Its prompt's blocks are cached for, and found cached by, requests of the same
        `cache_salt` and `adapter` only (as vLLM's). On an adapter it draws other tokens than
        on the base model."""
        cfg = self.config
        if request_id in self._by_id:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) > cfg.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens exceeds "
                f"max_model_len={cfg.max_model_len}"
            )
        low, high = _bounds(prompt_token_ids)
        if low < 0 or high >= cfg.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
        if max_tokens < 1 or min_tokens < 0:
            raise ValueError("max_tokens must be >= 1 and min_tokens >= 0")
        if adapter is not None and not cfg.max_loras:
            raise ValueError("this engine serves no LoRA adapters")
        if seed is None:
            seed = stable_hash(request_id)
        if adapter is not None:
            seed ^= stable_hash(adapter)
        prompt_len = len(prompt_token_ids)
        # (Compared, not min()ed: in Python 3.11 min() costs several calls' worth.)
        stop_length = prompt_len + max_tokens
        if stop_length > cfg.max_model_len:
            stop_length = cfg.max_model_len
        # Drawn as it steps if its tokens are reported, or if a draw may end it.
        draws_each_step = self.report_tokens or (not ignore_eos and cfg.eos_probability > 0)
        rng = _random.Random(seed) if draws_each_step else None
        # Positional, each named as its field: keywords cost as much again as the rest.
        seq = _Sequence(
            request_id,
            list(prompt_token_ids),
            prompt_len,
            min_tokens,
            ignore_eos,
            seed,
            rng,
            draws_each_step,
            stop_length,
            prompt_len,  # its length: its prompt's, to start with
        )
        if cfg.prefix_caching:
            seq.next_cached = cfg.block_size
        if cache_salt is not None or adapter is not None:
            seq.salt = seq.block_hash = stable_hash(f"{cache_salt}/{adapter}")
            seq.adapter = adapter
        self._by_id[request_id] = seq
        self._waiting.append(seq)

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` is unfinished: waiting or running."""
        return request_id in self._by_id

    def token_ids(self, request_id: str) -> list[int]:
        """An unfinished request's prompt and the tokens sampled for it so far (a step's
        tokens are sampled when it starts, before its outputs are read)."""
        return list(self._tokens(self._by_id[request_id]))

    def _tokens(self, seq: _Sequence) -> list[int]:
        """All of `seq`'s tokens: those not drawn yet are drawn now, in order, from its stream
        (as `step` would have drawn them)."""
        tokens = seq.tokens
        if len(tokens) < seq.length:
            if seq.rng is None:
                seq.rng = _random.Random(seq.seed)
            first = len(SPECIAL_TOKENS)
            span = self.config.vocab_size - first
            tokens += _draw_tokens(seq.rng, seq.length - len(tokens), first, span)
        return tokens

    def abort(self, request_id: str) -> bool:
        """Drop an unfinished request and free its blocks now; False if unknown or finished."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq in self._running:
            self._running.remove(seq)
            self._left_running(seq)
        else:
            self._waiting.remove(seq)
        self._free(seq)
        return True

    def step(self) -> StepResult:
        """Run one engine step; with no work it returns a zero-length, empty result."""
        cfg = self.config
        budget = cfg.max_batched_tokens
        block_size = cfg.block_size
        running = self._running
        scheduled: list[tuple[_Sequence, int]] = []
        preempted: list[str] = []

        # A preemption pops the running list's end: the loop stops short of what it popped.
        for seq in running:
            if budget <= 0:
                break
            n = seq.length - seq.computed
            if n > budget:
                n = budget
            # Unless its blocks hold the chunk, take more, preempting from the end for them.
            if -(-(seq.computed + n) // block_size) != seq.blocks and not self._make_room(
                seq, n, preempted
            ):
                break  # it was the last and preempted itself
            scheduled.append((seq, n))
            budget -= n

        passed_over: list[_Sequence] = []
        loaded = 0
        while not preempted and self._waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            seq = self._waiting[0]
            if seq.adapter is not None and not self._has_slot(seq.adapter):
                passed_over.append(self._waiting.popleft())
                self.slot_waits += 1
                continue
            if seq.computed == 0:
                seq.computed = self._cached_prefix(seq)
                if seq.generated == 0:
                    seq.cache_hit = seq.computed
            n = seq.length - seq.computed
            if n > budget:
                n = budget
            if not self._allocate(seq, n):
                break
            self._waiting.popleft()
            seq.prefill_until = seq.length
            running.append(seq)
            if seq.adapter is not None and self._take_slot(seq.adapter):
                loaded += 1
            scheduled.append((seq, n))
            budget -= n
        if passed_over:  # first again, in their order
            self._waiting.extendleft(reversed(passed_over))
        on_adapters = bool(self._on_adapter)  # (before this step's finished sequences leave)

        prefill_tokens = decode_tokens = 0
        request_ids: list[str] = []
        token_ids: list[int] = []
        finish_reasons: list[str | None] = []
        num_cached_tokens: dict[str, int] = {}
        # Each sequence samples its tokens from its own generator (`_sample`).
        first = len(SPECIAL_TOKENS)
        span = cfg.vocab_size - first
        bits = span.bit_length()
        eos_probability = cfg.eos_probability
        report_tokens = self.report_tokens
        # Bound once: a step of 128 sequences calls each 128 times.
        add_id, add_token, add_reason = request_ids.append, token_ids.append, finish_reasons.append
        for seq, n in scheduled:
            computed = seq.computed
            if computed < seq.prefill_until:
                end = computed + n
                prefill = (end if end < seq.prefill_until else seq.prefill_until) - computed
                prefill_tokens += prefill
                decode_tokens += n - prefill
            else:
                decode_tokens += n
            seq.computed = computed = computed + n
            if seq.next_cached <= computed:
                self._cache_blocks(seq)
            if computed != seq.length:
                continue  # a prefill chunk short of the prompt's end: no token yet
            seq.length = length = computed + 1
            reason = None
            if seq.draws_each_step:
                assert seq.rng is not None
                draw, stop_draw = _sample(seq.rng, span, bits)
                token = first + draw
                seq.tokens.append(token)
                if report_tokens:
                    add_token(token)
                if (
                    not seq.ignore_eos
                    and stop_draw < eos_probability
                    and length - seq.prompt_len >= seq.min_tokens
                ):
                    reason = "stop"
            if length >= seq.stop_length:
                reason = "length"
            add_id(seq.request_id)
            add_reason(reason)
            if length == seq.prompt_len + 1:  # its first token
                num_cached_tokens[seq.request_id] = seq.cache_hit
                if cfg.prefix_caching:
                    self.prefix_cache_queries += seq.prompt_len
                    self.prefix_cache_hits += seq.cache_hit
            if reason is not None:
                self._finish(seq)

        duration_ms = 0.0
        if scheduled:
            duration_ms = cfg.decode_ms(decode_tokens) + cfg.prefill_ms_per_token * prefill_tokens
            if on_adapters:
                duration_ms *= cfg.lora_step_factor
            duration_ms += cfg.lora_load_ms * loaded
        return StepResult(
            duration_ms / 1000.0,
            request_ids,
            token_ids,
            finish_reasons,
            num_cached_tokens,
            prefill_tokens,
            decode_tokens,
            tuple(preempted),
            loaded,
        )

    def _has_slot(self, adapter: str) -> bool:
        """Whether a sequence on `adapter` may run now: a running one holds its slot, or
        fewer adapters than slots run."""
        return adapter in self._on_adapter or len(self._on_adapter) < self.config.max_loras

    def _take_slot(self, adapter: str) -> bool:
        """A sequence on `adapter` starts running; whether that loads it into a slot (the
        least recently used one that no running adapter holds)."""
        running = self._on_adapter
        running[adapter] = running.get(adapter, 0) + 1
        slots = self._slots
        if adapter in slots:
            slots.move_to_end(adapter)
            return False
        if len(slots) >= self.config.max_loras:
            idle = next(name for name in slots if name not in running)
            del slots[idle]
        slots[adapter] = None
        return True

    def _left_running(self, seq: _Sequence) -> None:
        adapter = seq.adapter
        if adapter is not None:
            left = self._on_adapter[adapter] - 1
            if left:
                self._on_adapter[adapter] = left
            else:
                del self._on_adapter[adapter]

    def _cached_prefix(self, seq: _Sequence) -> int:
        """Tokens of `seq` the prefix cache holds, in whole blocks, short of its last token."""
        if not self.config.prefix_caching:
            return 0
        size = self.config.block_size
        cache = self._prefix_cache
        if seq.length <= size:
            return 0  # no whole block short of its last token
        tokens = self._tokens(seq)
        digest, blocks = seq.salt, 0
        while (blocks + 1) * size < len(tokens):
            digest = hash((digest, *tokens[blocks * size : (blocks + 1) * size]))
            if digest not in cache:
                break
            cache.move_to_end(digest)
            blocks += 1
        return blocks * size

    def _cache_blocks(self, seq: _Sequence) -> None:
        """Enter the full blocks `seq` has computed into the prefix cache (with prefix caching
        on, and only when it has computed a block more than it entered)."""
        size = self.config.block_size
        cache = self._prefix_cache
        tokens = self._tokens(seq)
        while (seq.cached_blocks + 1) * size <= seq.computed:
            start = seq.cached_blocks * size
            seq.block_hash = hash((seq.block_hash, *tokens[start : start + size]))
            cache[seq.block_hash] = None
            cache.move_to_end(seq.block_hash)
            seq.cached_blocks += 1
        seq.next_cached = (seq.cached_blocks + 1) * size
        while len(cache) > self.config.kv_blocks:
            cache.popitem(last=False)

    def _make_room(self, seq: _Sequence, new_tokens: int, preempted: list[str]) -> bool:
        """Blocks for `seq`'s next `new_tokens`, preempting the most recently started running
        sequences (named into `preempted`) until they fit; False if `seq` itself went."""
        running = self._running
        while not self._allocate(seq, new_tokens):
            victim = running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                return False
        return True

    def _allocate(self, seq: _Sequence, new_tokens: int) -> bool:
        needed = -(-(seq.computed + new_tokens) // self.config.block_size) - seq.blocks
        if needed > self.config.kv_blocks - self._blocks_used:
            return False
        seq.blocks += needed
        self._blocks_used += needed
        return True

    def _free(self, seq: _Sequence) -> None:
        self._blocks_used -= seq.blocks
        seq.blocks = 0

    def _preempt(self, seq: _Sequence) -> None:
        self._left_running(seq)
        self._free(seq)
        seq.computed = 0
        self._waiting.appendleft(seq)

    def _finish(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self._left_running(seq)
        del self._by_id[seq.request_id]
        self._free(seq)


# --------------------------------------------------------------------------- engine client
