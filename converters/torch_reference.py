"""A small PyTorch reference translator, one class per layout, in that layout's own convention.

Every class does the same three steps on a span of source K/V whose first token sits at
absolute position `start`:

  1. un-rotate the source keys with the source's RoPE (skipped for keys recorded before RoPE,
     e.g. pre-k_norm `k_proj` outputs: pass `keys_rotated=False`);
  2. map keys and values per target layer, exactly as the layout's trainer applies them
     (`F.linear` with `[out, in]` weights, `x @ W + b`, or per-layer `nn.Linear`);
  3. for a pre-k_norm cut apply the target's k_norm, then rotate with the target's RoPE at
     the same absolute positions.

Inputs are (L, B, H, T, D) like mlx-lm caches stacked over layers; outputs (Lt, B, Ht, T, Dt).
The parity tests compare our converted MLX translator against these classes; the files are
written with the public writers' own structure (tests/pytorch_writers.py). The modules are ordinary `nn.Module`s with differentiable
forwards, so they can also be trained on a GPU box and saved from there, e.g.:

    ref = MapperReference("full_head", src, tgt, k_rows, v_rows, src_rope, tgt_rope).cuda()
    opt = torch.optim.Adam(ref.parameters(), 1e-3)
    for keys, values, start, tk, tv in batches:           # target K/V as the teacher
        k, v = ref(keys.cuda(), values.cuda(), start)
        loss = F.mse_loss(k, tk.cuda()) + F.mse_loss(v, tv.cuda())
        opt.zero_grad(); loss.backward(); opt.step()
    tensors = ref.tensors()   # weights.safetensors names; manifest + SHA256SUMS as the
                              # writer makes them: tests/pytorch_writers.py `sr_mapper`

Geometry dicts: {"layers", "kv_heads", "head_dim"} (values use head_dim too).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

KEY_CUTS = ("post_norm", "pre_norm")


class RoPE:
    """RoPE as mlx's `mx.fast.rope`: halves (default) or interleaved pairs (`traditional`),
    positions times `scale`, inverse frequencies `base**(-2i/dims)` or `1/freqs`, and the first
    `dims` features multiplied by `mscale` (YaRN); the rest pass through unchanged."""

    def __init__(self, dims, base=10000.0, traditional=False, scale=1.0, freqs=None, mscale=1.0):
        self.dims, self.base, self.traditional = int(dims), base, bool(traditional)
        self.scale, self.mscale = float(scale), float(mscale)
        self.freqs = None if freqs is None else torch.as_tensor(freqs, dtype=torch.float64)

    @classmethod
    def from_mlx(cls, rope) -> RoPE:
        """From an mlx-lm model's RoPE module (`model.layers[i].self_attn.rope`)."""
        import numpy as np

        dims = getattr(rope, "dims", None) or rope.dim
        freqs = getattr(rope, "_freqs", None)
        mscale = getattr(rope, "mscale", None) or getattr(rope, "_scale", None) or 1.0
        if freqs is not None:
            return cls(
                dims, None, getattr(rope, "traditional", False), 1.0, np.array(freqs), mscale
            )
        return cls(dims, rope.base, rope.traditional, rope.scale)

    def angles(self, length: int, start: int, device) -> torch.Tensor:
        half = self.dims // 2
        if self.freqs is not None:
            inv = 1.0 / self.freqs
        else:
            inv = self.base ** (
                -torch.arange(0, self.dims, 2, dtype=torch.float64)[:half] / self.dims
            )
        pos = (start + torch.arange(length, dtype=torch.float64)) * self.scale
        return (pos[:, None] * inv[None, :]).to(device)

    def __call__(self, x: torch.Tensor, start: int, inverse: bool = False) -> torch.Tensor:
        """Rotate x (..., T, D) whose first token is at `start`; `inverse` undoes it."""
        theta = self.angles(x.shape[-2], start, x.device)
        cos, sin = torch.cos(theta).to(x.dtype), torch.sin(theta).to(x.dtype)
        if inverse:
            sin = -sin
        rot, rest = x[..., : self.dims], x[..., self.dims :]
        if inverse and self.mscale != 1.0:
            rot = rot / self.mscale
        if self.traditional:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        else:
            a, b = rot[..., : self.dims // 2], rot[..., self.dims // 2 :]
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        if not inverse and self.mscale != 1.0:
            out = out * self.mscale
        return torch.cat([out, rest], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def target_parts(loaded_model):
    """(RoPE, k_norm weights per layer or None, eps) of an mlx-kvlingo LoadedModel."""
    import numpy as np

    rope = RoPE.from_mlx(loaded_model.rope)
    if not loaded_model.geometry.has_k_norm:
        return rope, None, 0.0
    norms = [loaded_model.attention(i).k_norm for i in range(loaded_model.geometry.layers)]
    weights = [torch.from_numpy(np.array(n.weight, dtype=np.float32)) for n in norms]
    return rope, weights, float(norms[0].eps)


class ReferenceTranslator(nn.Module):
    """Un-rotate, map (subclasses), k_norm for the pre-norm cut, re-rotate."""

    variant = "mixing"

    def __init__(
        self, source: dict, target: dict, key_rows, value_rows, source_rope: RoPE,
        target_rope: RoPE, key_cut: str = "post_norm", target_k_norm=None, k_norm_eps=1e-6,
    ):  # fmt: skip
        super().__init__()
        if key_cut not in KEY_CUTS:
            raise ValueError(f"key_cut must be one of {KEY_CUTS}")
        self.source, self.target = dict(source), dict(target)
        self.key_rows = [list(r) for r in key_rows]
        self.value_rows = [list(r) for r in value_rows]
        assert len(self.key_rows) == len(self.value_rows) == target["layers"]
        self.source_rope, self.target_rope, self.key_cut = source_rope, target_rope, key_cut
        self.k_norm_eps = k_norm_eps
        if target_k_norm is not None:
            self.register_buffer(
                "k_norm", torch.stack(list(target_k_norm)).float(), persistent=False
            )
        else:
            self.k_norm = None

    # -- input features for one target layer ---------------------------------------------

    @staticmethod
    def flat(x: torch.Tensor) -> torch.Tensor:
        """(nu, B, H, T, D) -> (B, T, nu*H*D): the listed layers, each [head][dim]."""
        nu, B, H, T, D = x.shape
        return x.permute(1, 3, 0, 2, 4).reshape(B, T, nu * H * D)

    @staticmethod
    def per_head(x: torch.Tensor) -> torch.Tensor:
        """(nu, B, H, T, D) -> (B, H, T, nu*D): head h of each listed layer."""
        nu, B, H, T, D = x.shape
        return x.permute(1, 2, 3, 0, 4).reshape(B, H, T, nu * D)

    def unflat(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T, Ht*Dt) -> (B, Ht, T, Dt)."""
        B, T, _ = y.shape
        return y.reshape(B, T, self.target["kv_heads"], -1).transpose(1, 2)

    def map_layer(self, kind: str, t: int, x: torch.Tensor) -> torch.Tensor:
        """x: (nu, B, Hs, T, Ds) of the listed source layers -> (B, Ht, T, Dt)."""
        raise NotImplementedError

    def forward(self, keys, values, start: int, keys_rotated: bool = True):
        """keys/values: (Ls, B, Hs, T, Ds), first token at absolute position `start`."""
        keys, values = keys.float(), values.float()
        if keys_rotated:
            keys = self.source_rope(keys, start, inverse=True)
        out_k, out_v = [], []
        for t in range(self.target["layers"]):
            k = self.map_layer("k", t, keys[self.key_rows[t]])
            if self.key_cut == "pre_norm" and self.k_norm is not None:
                k = rms_norm(k, self.k_norm[t], self.k_norm_eps)
            out_k.append(self.target_rope(k, start))
            out_v.append(self.map_layer("v", t, values[self.value_rows[t]]))
        return torch.stack(out_k), torch.stack(out_v)

    # -- helpers --------------------------------------------------------------------------

    def in_width(self, rows) -> int:
        return len(rows) * self.source["kv_heads"] * self.source["head_dim"]

    @property
    def out_width(self) -> int:
        return self.target["kv_heads"] * self.target["head_dim"]

    @torch.no_grad()
    def randomize_(self, seed: int = 0, bias_scale: float = 0.1):
        """Random weights of unit-variance outputs (for tests); biases ~ N(0, bias_scale)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(("_b", ".bias")):
                p.copy_(torch.randn(p.shape, generator=g) * bias_scale)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(self.fan_in(name, p)))
        return self

    def fan_in(self, name: str, p: torch.Tensor) -> int:
        return p.shape[-1]


class KVLingoV1Reference(ReferenceTranslator):
    """Layout 1 (knlp kv_lingo.py `LinearTranslator`): `F.linear(x, W[l])`, W [Lt, Ht*Dt, Hs*Ds],
    equal depth, keys before k_norm. Its `state_dict()` is the writer's (`key_weight`,
    `value_weight`); knlp's `translator_artifact` / `checkpoint_state` wrap it (see
    tests/pytorch_writers.py for the exact structure)."""

    def __init__(self, source, target, source_rope, target_rope, target_k_norm=None, k_norm_eps=1e-6,
                 key_cut="pre_norm"):  # fmt: skip
        rows = [[t] for t in range(target["layers"])]
        super().__init__(source, target, rows, rows, source_rope, target_rope, key_cut,
                         target_k_norm, k_norm_eps)  # fmt: skip
        shape = (target["layers"], self.out_width, self.in_width([0]))
        self.key_weight = nn.Parameter(torch.zeros(shape))
        self.value_weight = nn.Parameter(torch.zeros(shape))

    def map_layer(self, kind, t, x):
        w = self.key_weight if kind == "k" else self.value_weight
        return self.unflat(F.linear(self.flat(x), w[t]))


class MapperReference(ReferenceTranslator):
    """Layout 2 (semantic-router distill.py `LinearMapper`): `x @ W + b` per target layer over
    all heads, W [nu*H*D, H*D]. `variant` is the manifest's label only (distill.py applies
    every variant this way).

    `key_rows` / `value_rows`: per target layer the source layers read (nu may vary by layer
    and between keys and values). Keys after k_norm, before RoPE. `tensors()` are the
    `weights.safetensors` names (`target.{t}.{k,v}.{W,b}`).
    """

    def __init__(self, variant, source, target, key_rows, value_rows, source_rope, target_rope,
                 bias=True):  # fmt: skip
        super().__init__(
            source, target, key_rows, value_rows, source_rope, target_rope, "post_norm"
        )
        if variant not in ("full_head", "per_head"):
            raise ValueError("variant must be full_head or per_head")
        self.mapper_variant, self.bias = variant, bias
        self.params = nn.ParameterDict()
        for kind, rows in (("k", self.key_rows), ("v", self.value_rows)):
            for t, r in enumerate(rows):
                w, b = (self.in_width(r), self.out_width), (self.out_width,)
                self.params[f"t{t}_{kind}_W"] = nn.Parameter(torch.zeros(w))
                if bias:
                    self.params[f"t{t}_{kind}_b"] = nn.Parameter(torch.zeros(b))

    def fan_in(self, name, p):
        return p.shape[-2]

    def map_layer(self, kind, t, x):
        w = self.params[f"t{t}_{kind}_W"]
        b = self.params[f"t{t}_{kind}_b"] if self.bias else None
        y = self.flat(x) @ w
        return self.unflat(y if b is None else y + b)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.params.items():
            t, kind, what = name[1:].split("_")
            out[f"target.{t}.{kind}.{what}"] = p.detach().cpu().contiguous()
        return out


class LinearMapsReference(ReferenceTranslator):
    """Layout 3: `k_maps[t]`, `v_maps[t]` are `nn.Linear` over the listed source layers."""

    def __init__(self, source, target, key_rows, value_rows, source_rope, target_rope,
                 key_cut="post_norm", bias=True, target_k_norm=None, k_norm_eps=1e-6):  # fmt: skip
        super().__init__(source, target, key_rows, value_rows, source_rope, target_rope, key_cut,
                         target_k_norm, k_norm_eps)  # fmt: skip
        self.k_maps = nn.ModuleList(
            nn.Linear(self.in_width(r), self.out_width, bias) for r in self.key_rows
        )
        self.v_maps = nn.ModuleList(
            nn.Linear(self.in_width(r), self.out_width, bias) for r in self.value_rows
        )

    def map_layer(self, kind, t, x):
        return self.unflat((self.k_maps if kind == "k" else self.v_maps)[t](self.flat(x)))

    def save(self, path, sidecar: bool = True, **names) -> Path:
        """torch.save the plain state_dict; with `sidecar`, `<path>.json` with geometry/map/cut."""
        path = Path(path)
        sd = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        torch.save(sd, str(path))
        if sidecar:
            meta = {
                "source": self.source,
                "target": self.target,
                "key_layers": self.key_rows,
                "value_layers": self.value_rows,
                "key_cut": self.key_cut,
                **names,
            }
            path.with_name(path.name + ".json").write_text(json.dumps(meta, indent=2))
        return path
