"""A small GPT-style language model and its LightningModule, used by the demo and the tests.

Like most existing modules, :class:`DemoGPT` returns a bare AdamW: the pack's callbacks install the schedule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tune._validation import check_choice, check_float, check_instance, check_int

#: How :class:`CausalSelfAttention` computes attention.
AttentionKind = Literal["sdpa", "eager"]
_ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT` model.

    Args:
        vocab_size: Number of token ids; inputs must lie in ``[0, vocab_size)``.
        seq_len: Longest sequence the model accepts (the size of the position embedding).
        d_model: Width of the residual stream; must be divisible by ``n_heads``.
        n_layers: Number of transformer blocks.
        n_heads: Number of attention heads.
        dropout: Dropout probability on attention weights and residual branches, in ``[0, 1)``.
        attention: ``"sdpa"`` to use :func:`torch.nn.functional.scaled_dot_product_attention` (which picks a fused
            kernel where one exists) or ``"eager"`` for the explicit ``softmax(QK^T / sqrt(d)) V`` reference.

    Raises:
        TypeError: If an integer field is not an integer or ``dropout`` is not a number.
        ValueError: If a field is out of range, ``d_model`` is not divisible by ``n_heads`` or ``attention`` is
            unknown.
    """

    vocab_size: int = 64
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    attention: AttentionKind = "sdpa"

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size, minimum=2)
        for name in ("seq_len", "d_model", "n_layers", "n_heads"):
            check_int(name, getattr(self, name), minimum=1)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"`d_model` must be divisible by `n_heads`, got d_model={self.d_model!r} and n_heads={self.n_heads!r}"
            )
        check_float("dropout", self.dropout, low=0.0, high=1.0, high_inclusive=False)
        check_choice("attention", self.attention, _ATTENTION_KINDS)

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``d_model // n_heads``."""
        return self.d_model // self.n_heads


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused query/key/value projection (``config.attention`` picks how)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.attention: AttentionKind = config.attention
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Attend each position of ``x`` (``[batch, seq, d_model]``) to itself and the positions before it."""
        batch, seq, width = x.shape
        # [B, S, 3D] -> 3 x [B, H, S, hd]
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        dropout_p = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
            weights = F.dropout(scores.softmax(dim=-1), p=dropout_p)
            out = weights @ v
        out = out.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.proj(out))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))`` with a 4x GELU MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block to ``x``, ``[batch, seq, d_model]``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-LN blocks, final LayerNorm, untied head.

    Args:
        config: Model shape; defaults to :class:`GPTConfig` ``()``.

    Raises:
        TypeError: If ``config`` is not a :class:`GPTConfig`.
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        config = GPTConfig() if config is None else config
        check_instance("config", config, GPTConfig, "a GPTConfig or None")  # None is the default config
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 initialisation: N(0, 0.02) everywhere, residual output projections scaled by 1/sqrt(2 * n_layers).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for block in self.blocks:
            block = cast(Block, block)
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(cast(nn.Linear, block.mlp[2]).weight, mean=0.0, std=residual_std)

    def forward(self, input_ids: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits ``[batch, seq, vocab_size]`` of ``input_ids`` ``[batch, seq]``, or their loss against ``targets``.

        Position ``t`` predicts token ``t + 1``. The loss is the mean cross-entropy, a target of ``-100`` adding none;
        the loss swap computes it without the logits.

        Raises:
            ValueError: If ``input_ids`` is not 2-D or is longer than ``config.seq_len``.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"`input_ids` must have shape [batch, seq], got shape {tuple(input_ids.shape)}")
        seq = input_ids.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"`input_ids` must be at most seq_len={self.config.seq_len} long, got length {seq}")
        positions = torch.arange(seq, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def num_parameters(self) -> int:
        """The number of scalar parameters."""
        return sum(p.numel() for p in self.parameters())


class DemoGPT(pl.LightningModule):
    """LightningModule wrapping :class:`GPT` for next-token prediction on ``(input_ids, targets)`` batches.

    Written like an ordinary user module, it logs ``train_loss`` and ``val_loss``.

    Args:
        config: Model shape, as a :class:`GPTConfig` or a mapping of its fields (the form stored in checkpoints'
            hyperparameters); defaults to :class:`GPTConfig` ``()``.
        lr: Peak learning rate of AdamW, > 0.
        weight_decay: Decoupled weight decay of ``Linear`` weights, >= 0 (the others are never decayed).

    Raises:
        TypeError: If an argument has the wrong type (``config``: a :class:`GPTConfig`, a mapping or ``None``).
        ValueError: If ``lr`` <= 0, ``weight_decay`` < 0, or a field of ``config`` is invalid.
    """

    def __init__(
        self, config: GPTConfig | Mapping[str, Any] | None = None, *, lr: float = 3e-3, weight_decay: float = 0.1
    ) -> None:
        super().__init__()
        if config is None:
            config = GPTConfig()
        elif isinstance(config, Mapping):
            config = GPTConfig(**config)
        check_instance("config", config, GPTConfig, "a GPTConfig, a mapping of its fields or None")
        check_float("lr", lr, low=0.0, low_inclusive=False)
        check_float("weight_decay", weight_decay, low=0.0)
        # Stored as a plain dict so that checkpoints and hparams.yaml hold only builtin types.
        self.save_hyperparameters({"config": dataclasses.asdict(config), "lr": lr, "weight_decay": weight_decay})
        self.config = config
        self.lr = lr
        self.weight_decay = weight_decay
        self.model = GPT(config)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Next-token logits ``[batch, seq, vocab_size]`` of ``input_ids`` ``[batch, seq]``."""
        return self.model(input_ids)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        input_ids, targets = batch
        return self.model(input_ids, targets)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Log and return the mean next-token cross-entropy of ``(input_ids, targets)`` as ``train_loss``."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch[0].shape[0])
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Return the validation loss of a batch and log its epoch mean as ``val_loss``."""
        loss = self._loss(batch)
        self.log("val_loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch[0].shape[0])
        return loss

    def predict_step(self, batch: Tensor | tuple[Tensor, ...] | list[Tensor], batch_idx: int) -> Tensor:
        """Next-token logits of ``input_ids`` alone or of ``(input_ids, targets)`` (targets ignored)."""
        input_ids = batch if isinstance(batch, Tensor) else batch[0]
        return self.model(input_ids)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW (``betas=(0.9, 0.95)``), no scheduler: ``Linear`` weights decayed, biases, norms and embeddings not."""
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        seen: set[int] = set()
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if isinstance(module, nn.Linear) and name == "weight":
                    decay.append(param)
                elif isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)):
                    no_decay.append(param)
                else:
                    raise RuntimeError(f"parameter {name!r} of {type(module).__name__} has no weight-decay group")
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
