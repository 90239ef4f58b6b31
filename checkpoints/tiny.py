"""Deterministic random-weight checkpoints (llama / qwen2) with a byte-level BPE tokenizer.

`make_tiny_model` writes a transformers checkpoint directory that `AutoModelForCausalLM` and
`AutoTokenizer` load offline: weights come from `seed` alone, the tokenizer is trained on the
bundled `checkpoints/corpus/*.txt` and carries a simple chat template (`CHAT_TEMPLATE`).
`ensure_model` builds one only where `config.json` is absent, in a sibling temp dir renamed
into place, so racing processes never see a half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

Arch = Literal["llama", "qwen2"]
Size = Literal["tiny", "bench", "gemma3-270m"]

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2: the trainer puts them first
BOS_ID, EOS_ID, PAD_ID = range(3)
# Each turn is `<|bos|>role\ncontent<|eos|>\n`; the generation prompt opens an assistant turn,
# so a reply ends at EOS like any completion. Random weights: the replies are noise, but the
# chat paths (rendering, streaming, conversation) are testable on the tiny model.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|bos|>' + message['role'] + '\n' + message['content'] + '<|eos|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|bos|>assistant\n' }}{% endif %}"
)
SPLIT_REGEX = (  # Qwen2's pre-tokenizer split, also used for llama
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True)
class ModelSize:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    head_dim: int | None = None  # None: hidden_size / num_attention_heads
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # the saved weights'


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(2048, 64, 2, 4, 2, 128, 2048),
    "bench": ModelSize(32000, 512, 8, 8, 4, 1408, 4096),
    # Gemma 3 270M's shape on Llama's layers: a 262,144-token vocabulary whose tied embedding is
    # 63% of the weights, so decode's head (a 262k x 640 product per token) outweighs the layers
    "gemma3-270m": ModelSize(262144, 640, 18, 4, 1, 2048, 32768, head_dim=256, tie_word_embeddings=True,
                             dtype="bfloat16"),
}
ARCHS = ("llama", "qwen2")

# Init gains. Weights get std gain / sqrt(fan_in), so every layer's output is O(1) whatever
# the width and attention/MLP updates are as large as the O(1) embeddings: the next token
# then depends on the whole context, not just the last token (HF's std=0.02 init leaves
# tiny models repeating one token). A large LM-head gain spreads the logits (std ~4) so
# greedy argmaxes are far from ties and robust to kernel-level float differences.
EMBED_STD = 1.0
LINEAR_GAIN = 1.0
QK_GAIN = 1.5  # attention scores with std ~QK_GAIN**2: peaked but not one-hot
BIAS_STD = 0.1
LM_HEAD_GAIN = 4.0


def _corpus_texts() -> list[str]:
    files = sorted(CORPUS_DIR.glob("*.txt"))
    assert files, f"no corpus files in {CORPUS_DIR}"
    return [f.read_text(encoding="utf-8") for f in files]


def _empty_tokenizer(arch: Arch) -> Tokenizer:
    """Byte-level BPE with Qwen2's split regex (digits one by one) and no automatic specials."""
    tokenizer = Tokenizer(models.BPE())
    if arch == "qwen2":
        # transformers rebuilds every qwen2 tokenizer with NFC whatever tokenizer.json says, so
        # the file says it too; llama keeps exact round trips of non-NFC text.
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def train_tokenizer(arch: Arch, vocab_size: int) -> tuple[Tokenizer, int]:
    """Train on the corpus: 3 specials, 256 byte symbols, merges, then fillers up to vocab_size.

    Returns the tokenizer and the number of trained (non-filler) ids.
    """
    tokenizer = _empty_tokenizer(arch)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_texts(), trainer)
    num_trained = tokenizer.get_vocab_size()
    return _pad_vocab(tokenizer, vocab_size), num_trained


def _pad_vocab(tokenizer: Tokenizer, vocab_size: int) -> Tokenizer:
    """Fill ids the corpus has no merges for (bench) with `<|reserved_N|>` vocab entries.

    No merge leads to them, so encoding never yields them; they decode to their literal name.
    len(tokenizer) == config.vocab_size then holds, so every id a model emits decodes.
    """
    state = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    for token_id in range(len(vocab), vocab_size):
        vocab[f"<|reserved_{token_id}|>"] = token_id
    return Tokenizer.from_str(json.dumps(state))


def save_tokenizer(tokenizer: Tokenizer, max_len: int, out: Path) -> None:
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,  # keep decode(encode(s)) == s
        chat_template=CHAT_TEMPLATE,
    )
    hf_tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    # A class name transformers 4 and 5 both load; no unk token, or transformers 5's
    # Qwen2Tokenizer adds an `<|endoftext|>` one past the model's vocab.
    config.update(tokenizer_class="PreTrainedTokenizerFast", unk_token=None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_config(arch: Arch, size: Size):
    """The transformers config for one (arch, size); qwen2 adds q/k/v biases by design."""
    _check_choices(arch, size)
    config_cls = LlamaConfig if arch == "llama" else Qwen2Config
    shape = {k: v for k, v in asdict(SIZES[size]).items() if v is not None}
    return config_cls(
        **shape,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def _check_choices(arch: str, size: str) -> None:
    for name, value, choices in (("arch", arch, ARCHS), ("size", size, tuple(SIZES))):
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


def _init_std(name: str, param: torch.Tensor) -> float | None:
    """Std for a normal init of one parameter; None means constant ones (norm weights)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):
        return BIAS_STD
    if "embed_tokens" in name:
        return EMBED_STD
    fan_in = param.shape[1]
    if name.startswith("lm_head"):
        return LM_HEAD_GAIN / fan_in**0.5
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return QK_GAIN / fan_in**0.5
    return LINEAR_GAIN / fan_in**0.5


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int, muted_ids: list[int]) -> None:
    """Overwrite every parameter from one CPU generator, in sorted-name order.

    `muted_ids` get all-zero LM-head rows: logit 0, far below the top logit, so greedy
    decoding never emits them (BOS, PAD, vocab fillers) while EOS stays an ordinary token.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        std = _init_std(name, param)
        if std is None:
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.get_output_embeddings().weight[muted_ids] = 0.0


def _build_model(arch: Arch, size: Size, seed: int, muted_ids: list[int]):
    model = AutoModelForCausalLM.from_config(build_config(arch, size), dtype=torch.float32)
    init_weights(model, seed, muted_ids)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    return model


def make_tiny_model(out_dir: str | os.PathLike[str], arch: Arch = "llama", size: Size = "tiny",
                    seed: int = 0) -> Path:
    """Write a checkpoint (config, safetensors, generation config, tokenizer) to `out_dir`."""
    out = Path(out_dir)
    _check_choices(arch, size)
    shape = SIZES[size]
    tokenizer, num_trained = train_tokenizer(arch, shape.vocab_size)
    muted_ids = [BOS_ID, PAD_ID, *range(num_trained, shape.vocab_size)]
    model = _build_model(arch, size, seed, muted_ids)
    out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, shape.dtype)).save_pretrained(out)
    save_tokenizer(tokenizer, shape.max_position_embeddings, out)
    return out


def ensure_model(path: str | os.PathLike[str], arch: Arch = "llama", size: Size = "tiny") -> Path:
    """Return `path`, first building a seed-0 model there if it has no config.json."""
    target = Path(path)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        make_tiny_model(staging, arch=arch, size=size)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _publish(staging: Path, target: Path) -> None:
    """Atomically move `staging` to `target`; losing the race to another builder is fine."""
    try:
        os.rename(staging, target)  # replaces a missing or empty dir atomically
    except OSError as err:
        if not (target / "config.json").exists():
            raise FileExistsError(f"{target} is not empty and has no config.json; "
                                  "remove it or choose another model path") from err
