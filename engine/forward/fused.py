"""A decoder layer's small ops fused, on CPU: one q|k|v projection with rotary in place, one gate|up.

A layer written as transformers' Llama, Mistral and Qwen2 ones are runs, per step, three
projections for q, k and v, rotary as five ops on each of q and k (two multiplies, a negation, a
concatenation, an add), and an MLP whose gate and up projections read the same input. On a decode
step each op is a dispatch and an allocation for a few rows; on a prefill chunk each elementwise op
is a pass over the chunk's activations. Here:

- `FusedAttention`: the q, k and v weights stacked into one linear (one small-batch GEMM or
  oneDNN call), rotary applied in place to its q and k heads by the CPU kernel (`pd_rope`,
  engine/kernels/csrc/rope.c: products and sums rounded as torch rounds them), and q, k, v handed to paged
  attention as views of that one output;
- `FusedMLP`: gate and up stacked into one linear, the activation on the gate half times the up
  half (for SiLU, one CPU kernel call, `pd_silu_mul`, engine/kernels/csrc/silu_mul.c: torch's own exp,
  reproduced), then down.

Each is swapped in only where it gives the module's own outputs bit for bit — its q, k, v, the
keyword arguments it hands the attention function, and its output — on probe inputs of 1, 7, 64
and 100 rows (or `SMALL_ROWS` + 1 where oneDNN takes the products past it), checked per module at
load with the linears packed as they will serve. A module with anything else inside (Qwen3's q/k
norms, Gemma's scaled activations) fails the check or is not a candidate, and stays as it is. The
swap only happens where linears are prepacked (engine/forward/dense.py) and outside a compiled decoder,
whose elementwise ops inductor fuses itself; a forward traced by the compiler takes torch's
rotary instead of the kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.forward import attention, dense, features
from engine.kernels import cpu_kernel

log = logging.getLogger(__name__)

# either side of SMALL_ROWS (the GEMM's products and oneDNN's) where it is set; a prefill chunk's size where not
PROBE_ROWS = (1, 7, 64, 100 if cpu_kernel.SMALL_ROWS is None else cpu_kernel.SMALL_ROWS + 1)


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the given linears' outputs side by side."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) != all(b is None for b in biases):
        raise ValueError("some of the linears have a bias and some have none")
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if biases[0] is not None:
        stacked.bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
    return stacked


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedAttention(nn.Module):
    """A Llama-shaped attention module's forward on one stacked q|k|v linear; same outputs."""

    def __init__(self, attn: nn.Module, qkv: nn.Module, heads: int, kv_heads: int, call: dict, rope=None):
        super().__init__()
        self.config, self.layer_idx, self.head_dim = attn.config, attn.layer_idx, attn.head_dim
        self.is_causal = getattr(attn, "is_causal", True)
        self.heads, self.kv_heads = heads, kv_heads
        self.qkv_proj, self.o_proj = qkv, attn.o_proj
        self.call = call  # what the module hands the attention function: scaling, sliding_window, softcap
        self.rope = rope  # cpu_ops.Rope, or None: torch's ops

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, **kwargs):
        lead = hidden_states.shape[:-1]  # [1, T]
        qkv = self.qkv_proj(hidden_states)
        q_end = self.heads * self.head_dim
        k_end = q_end + self.kv_heads * self.head_dim
        cos, sin = position_embeddings
        if self.rope is not None and qkv.dtype in cpu_kernel.DTYPES and not torch.compiler.is_compiling():
            flat = qkv.view(-1, qkv.shape[-1])
            self.rope(flat, self.heads + self.kv_heads, self.head_dim, cos.reshape(flat.shape[0], -1),
                      sin.reshape(flat.shape[0], -1))
            q, k = qkv[..., :q_end], qkv[..., q_end:k_end]
        else:
            q = qkv[..., :q_end].view(*lead, self.heads, self.head_dim)
            k = qkv[..., q_end:k_end].view(*lead, self.kv_heads, self.head_dim)
            c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
            q, k = (q * c) + (_rotate_half(q) * s), (k * c) + (_rotate_half(k) * s)
        q = q.reshape(*lead, self.heads, self.head_dim).transpose(1, 2)
        k = k.reshape(*lead, self.kv_heads, self.head_dim).transpose(1, 2)
        v = qkv[..., k_end:].view(*lead, self.kv_heads, self.head_dim).transpose(1, 2)
        out, weights = attention.paged_attention(self, q, k, v, attention_mask, **self.call)
        return self.o_proj(out.reshape(*lead, -1).contiguous()), weights

    def extra_repr(self) -> str:
        return f"heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, " \
               f"rotary={'CPU kernel' if self.rope is not None else 'torch'}"


class FusedMLP(nn.Module):
    """A gated MLP's forward on one stacked gate|up linear; same outputs."""

    def __init__(self, mlp: nn.Module, gate_up: nn.Module, silu_mul=None):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up, mlp.down_proj, mlp.act_fn
        self.intermediate = mlp.gate_proj.out_features
        self.silu_mul = silu_mul  # cpu_ops.SiluMul for a SiLU activation, or None: torch's ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_mul is not None and gate_up.dtype in cpu_kernel.DTYPES and not torch.compiler.is_compiling():
            return self.down_proj(self.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)

    def extra_repr(self) -> str:
        return f"activation={'silu(gate) * up by the CPU kernel' if self.silu_mul is not None else 'torch'}"


@dataclass
class _Capture:
    """Stands in for attention while a fused module is checked: records what the module hands the
    attention function and returns its queries (so the output depends on them)."""

    calls: list = field(default_factory=list)

    def record(self, module, query, key, value, attention_mask, scaling, sliding_window, softcap, kwargs):
        self.calls.append((query.clone(), key.clone(), value.clone(), scaling, sliding_window, softcap))
        return query.transpose(1, 2).contiguous(), None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return isinstance(b, tuple | list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _probe_inputs(size: int, dtype: torch.dtype, device: torch.device, head_dim: int | None = None):
    generator = torch.Generator().manual_seed(0)
    for rows in PROBE_ROWS:
        x = torch.randn(1, rows, size, generator=generator).to(device, dtype)
        if head_dim is None:
            yield x, None
            continue
        angles = torch.rand(1, rows, head_dim // 2, generator=generator) * 100.0
        angles = torch.cat((angles, angles), dim=-1)
        yield x, (angles.cos().to(device, dtype), angles.sin().to(device, dtype))


def _attention_call(module: nn.Module, x: torch.Tensor, position_embeddings) -> tuple[list, torch.Tensor]:
    capture = _Capture()
    with features.probing(capture):
        out, _ = module(hidden_states=x, position_embeddings=position_embeddings, attention_mask=None)
    return capture.calls, out


@torch.inference_mode()
def _fuse_attention(attn: nn.Module, device: torch.device, gemm, rope) -> FusedAttention | None:
    config = attn.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    qkv = _stacked([attn.q_proj, attn.k_proj, attn.v_proj])
    dtype = qkv.weight.dtype
    dense.pack_linears(attn, device, gemm=gemm)
    dense.pack_linears(holder := nn.Sequential(qkv), device, gemm=gemm)
    probes = []
    for x, angles in _probe_inputs(qkv.in_features, dtype, device, attn.head_dim):
        calls, out = _attention_call(attn, x, angles)
        if len(calls) != 1:
            return None
        probes.append((x, angles, calls, out))
    call = dict(zip(("scaling", "sliding_window", "softcap"), probes[0][2][0][3:], strict=True))
    for kernel in (rope, None) if rope is not None else (None,):  # the rotary kernel, else torch's ops
        candidate = FusedAttention(attn, holder[0], heads, kv_heads, call, kernel)
        if all(_same((calls, out), _attention_call(candidate, x, angles)) for x, angles, calls, out in probes):
            return candidate
    return None


@torch.inference_mode()
def _fuse_mlp(mlp: nn.Module, device: torch.device, gemm, silu_mul) -> FusedMLP | None:
    gate_up = _stacked([mlp.gate_proj, mlp.up_proj])
    size, dtype = gate_up.in_features, gate_up.weight.dtype
    dense.pack_linears(mlp, device, gemm=gemm)
    dense.pack_linears(holder := nn.Sequential(gate_up), device, gemm=gemm)
    silu = type(mlp.act_fn).__name__ in ("SiLU", "SiLUActivation")
    for kernel in (silu_mul, None) if silu and silu_mul is not None else (None,):
        candidate = FusedMLP(mlp, holder[0], kernel)
        try:
            if all(_same(mlp(x), candidate(x)) for x, _ in _probe_inputs(size, dtype, device)):
                return candidate
        except cpu_kernel.KernelUnavailable:
            continue  # the kernel cannot give torch's bits here: torch's ops, checked the same way
    return None


def _is_attention(module: nn.Module) -> bool:
    names = {name for name, _ in module.named_children()}
    return (names == {"q_proj", "k_proj", "v_proj", "o_proj"}
            and all(type(getattr(module, n)) is nn.Linear for n in names)
            and hasattr(module, "config") and hasattr(module, "layer_idx") and hasattr(module, "head_dim")
            and module.head_dim % 2 == 0)


def _is_gated_mlp(module: nn.Module) -> bool:
    names = {name for name, _ in module.named_children()}
    if not {"gate_proj", "up_proj", "down_proj"} <= names or not names <= {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return False
    gate, up, down = module.gate_proj, module.up_proj, module.down_proj
    return (all(type(m) is nn.Linear for m in (gate, up, down)) and hasattr(module, "act_fn")
            and gate.in_features == up.in_features and gate.out_features == up.out_features == down.in_features)


def fuse_layers(model: nn.Module, device: torch.device, gemm=None, rope=None, silu_mul=None,
                skip: nn.Module | None = None) -> tuple[int, int]:
    """Swap each Llama-shaped attention and gated MLP of `model` (outside `skip`) whose fused form
    gives its outputs bit for bit for a `FusedAttention` / `FusedMLP`; their linears are packed
    (engine/forward/dense.py) as they go. Only where linears are packed (CPU, float32, oneDNN). Returns
    (attention modules fused, MLPs fused)."""
    if not dense.can_pack(model, device, gemm):
        return 0, 0
    fused = {FusedAttention: 0, FusedMLP: 0}
    for parent, name, child in dense.child_modules(model, skip):
        if not (_is_attention(child) or _is_gated_mlp(child)):
            continue
        why = "its fused form does not give its outputs bit for bit"
        try:
            swap = _fuse_attention(child, device, gemm, rope) if _is_attention(child) else _fuse_mlp(child, device, gemm, silu_mul)
        except Exception as exc:  # noqa: BLE001 - a module the probe cannot call is served as it is
            swap, why = None, f"the check could not call it ({type(exc).__name__}: {exc})"
        if swap is None:
            log.info("%s.%s (%s) stays unfused: %s", type(parent).__name__, name, type(child).__name__, why)
            continue
        setattr(parent, name, swap)
        fused[type(swap)] += 1
    return fused[FusedAttention], fused[FusedMLP]
