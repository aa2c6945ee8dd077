"""Build the demo model: a tiny random-weight Llama with a real tokenizer and chat template.

Nothing can be downloaded here, so Sluice makes its own model: 2 layers, hidden size 256,
4 attention heads, random bf16 weights (fixed seed) saved by `transformers`, and a byte-level
BPE tokenizer trained with `tokenizers` on text that ships with this module. Its output is
gibberish, but every engine path is real: tokenization, chat template, KV cache, batching.
The build is deterministic and takes seconds.

The weights are random but *decisive*: the embeddings dominate the residual stream, and the
output layer maps each token's embedding to one successor (a random cycle through the ordinary
tokens), so the likeliest next token leads the second by several nats (`GREEDY_MARGIN`). A
plainly random model has nearly flat logits: greedy decoding then turns on near-ties that CPUs
with other kernels (AVX2 against AVX-512), other batch shapes, or prefill against decode break
differently. With the margin, greedy text and top logprobs are the same on any hardware, which
is what the tests that compare them rely on (`tests/engine_adapters/test_demo_model.py` checks
the margin on the engine itself). Sampling at temperature 1 stays varied: the successor has
about half the probability (48% here), the rest is spread over the vocabulary.

Its LoRA adapters (`build_demo_adapter`) keep that: a PEFT adapter on the output layer that
swaps the likeliest successors of a few tokens, among them the first token of every chat
answer, so a chat for the adapter visibly answers otherwise, and as steadily.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEMO_MODEL_NAME = "sluice-demo"
DEMO_ADAPTER_NAME = "sluice-demo-lora"
DEMO_ADAPTER_VERSION = 3  # bumped when its weights change, as the model's (2: rank 256)
DEMO_ADAPTER_RANK = 8  # swaps of two output rows (within vLLM's default max_lora_rank, 16)
# Bumped when the weights change, so that a cached model of an older build is rebuilt.
DEMO_MODEL_VERSION = 2
VERSION_FILE = "sluice-demo-model.json"
# The successor's logit; the others are about N(0, (SUCCESSOR_LOGIT / 16)^2) (hidden size 256),
# so the greedy choice leads by about 5 nats, and the tests require at least GREEDY_MARGIN.
SUCCESSOR_LOGIT = 7.0
GREEDY_MARGIN = 2.0
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# The training text: plain English about the project's own domain, repeated with variation so
# the BPE merges are stable. Kept in code so the build needs no file from anywhere else.
_CORPUS_LINES = (
    "A scheduler decides who waits, how long they wait, and what happens when the promise "
    "no longer fits.",
    "The model's stopwatch starts after the waiting is over. Your user's stopwatch does not.",
    "Time to first token, time between tokens and full completion are measured separately.",
    "When a compatible worker is free, dispatch if the batch is full or the oldest request "
    "has reached its batching delay limit.",
    "Bound the queue by count and memory, and expire requests whose deadlines have passed.",
    "Reject excess work with an honest overload response rather than an ever-growing backlog.",
    "A client that disconnects stops costing engine time at once.",
    "Interactive traffic is a person waiting; bulk traffic is a job that can wait a little.",
    "Hello! How can I help you today? Please tell me more about your question.",
    "The quick brown fox jumps over the lazy dog while the server streams tokens to the browser.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols like , . ; : ! ? ( ) [ ] { } "
    "\" ' - + = * / % # @ & appear in text.",
)


def _corpus() -> list[str]:
    lines = []
    for i in range(40):
        for j, line in enumerate(_CORPUS_LINES):
            words = line.split()
            k = (i * 7 + j) % len(words)
            lines.append(" ".join(words[k:] + words[:k]))
            lines.append(line.lower() if i % 2 else line.upper())
    return lines


def _stamp(path: Path) -> dict[str, Any]:
    """What a build at `path` says it is ({}: no complete build there)."""
    try:
        stamp = json.loads((path / VERSION_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def _build_once(path: Path, built: Callable[[], bool], build: Callable[[], None]) -> Path:
    """`build()` unless `built()`; one builder at a time (parallel test workers, several
    servers starting): the others wait, then find it built."""
    if built():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built():
            build()
    return path


def is_demo_model(path: Path) -> bool:
    """A complete build of this version of the demo model is at `path`."""
    return (
        _stamp(path).get("version") == DEMO_MODEL_VERSION
        and (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
        and any(path.glob("*.safetensors"))
    )


def build_demo_model(path: Path, *, force: bool = False) -> Path:
    """Build the demo model at `path` (no-op if one is already there, unless `force`)."""
    path = Path(path)
    return _build_once(path, lambda: is_demo_model(path) and not force, lambda: _build(path))


def _build(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    staging = path.with_name(path.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(staging)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",  # type: ignore[call-arg]  # recorded in config.json
    )
    model = LlamaForCausalLM(config)
    _make_decisive(model, special_ids=set(fast.all_special_ids))
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(staging, safe_serialization=True)
    (staging / "generation_config.json").write_text(
        json.dumps({"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id})
    )
    (staging / VERSION_FILE).write_text(json.dumps({"version": DEMO_MODEL_VERSION}))
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)


def is_demo_adapter(path: Path, variant: int = 1) -> bool:
    """A complete build of this version and variant of the demo adapter is at `path`."""
    stamp = _stamp(path)
    return (
        stamp.get("version") == DEMO_ADAPTER_VERSION
        and stamp.get("variant") == variant
        and (path / "adapter_config.json").is_file()
        and (path / "adapter_model.safetensors").is_file()
    )


def build_demo_adapter(path: Path, model: Path, *, variant: int = 1, force: bool = False) -> Path:
    """Build a LoRA adapter of the demo model at `model` at `path` (no-op if one of this
    `variant` is already there, unless `force`); each variant swaps other tokens.

    A PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`) of rank
    `DEMO_ADAPTER_RANK` on the output layer, whose update swaps the output rows of
    `DEMO_ADAPTER_RANK` pairs of tokens: whatever led to one leads to the other, exactly as
    decisively (the logits are the same numbers, swapped). The first pair is the first token of
    every chat answer (the successor of `<|assistant|>`) and one the variant draws, so an
    answer differs from the base model's from its first token on (and, where a completion's
    chain of successors meets a swapped token, from there on), and holds across batch shapes
    and CPUs as the base model's does. Rank 8 keeps vLLM's LoRA ops on CPU cheap: they gather a
    (vocabulary x rank) matrix per token (`sluice serve --demo-lora` builds and serves
    variant 1).
    """
    path, model = Path(path), Path(model)
    return _build_once(
        path,
        lambda: is_demo_adapter(path, variant) and not force,
        lambda: _build_adapter(path, model, variant),
    )


def _build_adapter(path: Path, model: Path, variant: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    weights = load_file(str(model / "model.safetensors"))
    embeddings = weights["model.embed_tokens.weight"].float()
    rows = weights["lm_head.weight"].float()
    tokenizer = AutoTokenizer.from_pretrained(model)
    special = set(tokenizer.all_special_ids)
    # The first token of every chat answer: the successor of the generation prompt's token.
    assistant = embeddings[tokenizer.convert_tokens_to_ids("<|assistant|>")]
    first = int((rows @ (assistant / assistant.pow(2).mean().sqrt())).argmax())
    generator = torch.Generator().manual_seed(1 + variant)
    others = [i for i in range(len(rows)) if i not in special and i != first]
    chosen = [others[int(i)] for i in torch.randperm(len(others), generator=generator)]
    pairs = [(first, chosen[0])]
    pairs += [(chosen[k], chosen[k + 1]) for k in range(1, 2 * DEMO_ADAPTER_RANK - 2, 2)]
    # Swapping rows a and b of the output layer swaps their logits: whatever led to a leads to
    # b, as decisively. Each swap is W[a] += W[b] - W[a], W[b] -= the same: rank one, so B A
    # (PEFT's scaling lora_alpha / r = 1) with A's row p that difference, B's column p +1 at
    # a and -1 at b.
    lora_a = torch.stack([rows[b] - rows[a] for a, b in pairs])
    lora_b = torch.zeros(len(rows), len(pairs))
    for p, (a, b) in enumerate(pairs):
        lora_b[a, p], lora_b[b, p] = 1.0, -1.0
    staging = path.with_name(path.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    prefix = "base_model.model.lm_head"
    tensors = {
        f"{prefix}.lora_A.weight": lora_a.to(torch.bfloat16).contiguous(),
        f"{prefix}.lora_B.weight": lora_b.to(torch.bfloat16).contiguous(),
    }
    save_file(tensors, str(staging / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": DEMO_MODEL_NAME,
        "r": DEMO_ADAPTER_RANK,
        "lora_alpha": DEMO_ADAPTER_RANK,
        "lora_dropout": 0.0,
        "target_modules": ["lm_head"],
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
    stamp = {"version": DEMO_ADAPTER_VERSION, "variant": variant}
    (staging / VERSION_FILE).write_text(json.dumps(stamp))
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)


def _successor_rows(embeddings: Any, special_ids: set[int], generator: Any) -> Any:
    """The output layer that gives each token one likely successor (see `_make_decisive`)."""
    import torch

    vocab, hidden = embeddings.shape
    normalised = embeddings / embeddings.pow(2).mean(dim=1, keepdim=True).sqrt()
    ordinary = [i for i in range(vocab) if i not in special_ids]
    cycle = [ordinary[int(i)] for i in torch.randperm(len(ordinary), generator=generator)]
    successor = {token: cycle[(k + 1) % len(cycle)] for k, token in enumerate(cycle)}
    for k, token in enumerate(sorted(special_ids)):
        successor[token] = cycle[(k * 97) % len(cycle)]
    output = torch.zeros(vocab, hidden)
    for token, following in successor.items():
        output[following] += normalised[token]
    return output * (SUCCESSOR_LOGIT / hidden)


def _make_decisive(model: Any, special_ids: set[int]) -> None:
    """Give each token one likely successor (see the module's docstring).

    Embeddings of unit scale outweigh what the random layers add to the residual stream
    (about a tenth), so the final norm's output is close to the last token's normalised
    embedding `e`. Row j of the output layer is `SUCCESSOR_LOGIT * e(i) / hidden` for each
    token i whose successor is j, so token i's successor scores about SUCCESSOR_LOGIT and every
    other token a random dot product about 16 times smaller. The ordinary tokens form one
    random cycle (no short loops in greedy text); each special token leads to an ordinary one,
    and no token leads to a special one, so greedy text never ends by itself.
    """
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        vocab, hidden = embeddings.shape
        embeddings.copy_(torch.randn(vocab, hidden, generator=generator))
        model.lm_head.weight.copy_(_successor_rows(embeddings, special_ids, generator))
