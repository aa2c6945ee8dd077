"""Build the demo model: a tiny random-weight Llama with a real tokenizer and chat template.

Nothing can be downloaded here, so Sluice makes its own model: 2 layers, hidden size 256,
4 attention heads, random bf16 weights (fixed seed) saved by `transformers`, and a byte-level
BPE tokenizer trained with `tokenizers` on text that ships with this module. Its output is
gibberish, but every engine path is real: tokenization, chat template, KV cache, batching.
The build is deterministic and takes seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

DEMO_MODEL_NAME = "sluice-demo"
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


def is_demo_model(path: Path) -> bool:
    return (
        (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
        and any(path.glob("*.safetensors"))
    )


def build_demo_model(path: Path, *, force: bool = False) -> Path:
    """Build the demo model at `path` (no-op if one is already there, unless `force`)."""
    path = Path(path)
    if is_demo_model(path) and not force:
        return path
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
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(staging, safe_serialization=True)
    (staging / "generation_config.json").write_text(
        json.dumps({"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id})
    )
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)
    return path
