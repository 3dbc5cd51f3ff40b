"""GEMM forms for a fp32 CPU weight, one per row count: what `Linear.set_layouts` installs.

A decode step multiplies one row by each weight (a GEMV), a verify step the B rows of a block, a batch
b or b*B rows. For those few rows the fastest form depends on the CPU and its BLAS (layout_tuning.py
measures it), so a tuned Linear carries a `Layout`: the forms it chose and the weight copies they need.

Every form must give a row the same bits whatever the row count, or a token's K/V would depend on how its
forward was batched or chunked (docs/architecture.md, Invariants). MKL takes one row as a GEMV that sums in
another order than its GEMM, and its NT GEMM rounds by row count: so the stored form (`stored_product`)
takes one row as two, and a form is only kept where it gives the stored form's bits (`Layout.build`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LAYOUTS = ("nn", "nt", "wx", "packed")
SMALL_ROWS = 64  # a form planned for "any other row count" (key 0) serves 2..SMALL_ROWS rows (batches)
# Row counts at which a key-0 form is compared with the stored form, bit for bit, before it is kept.
CHECK_ROWS = (2, 3, 4, 5, 8, 16, 17, 33, SMALL_ROWS)


def stored_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) on the stored weight [out, in], on the CPU in a form whose rows do not round by the row
    count: one row goes as two (a GEMM, not a GEMV), and a row-major weight (a tied head's embedding) as
    W x^T (the weight as the GEMM's left operand; MKL's NT form rounds by row count)."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, -1)
    flat = flat if rows > 1 else torch.cat((flat, flat))
    if weight.is_contiguous():
        cols = flat.t()
        out = (torch.mm(weight, cols) if bias is None else torch.addmm(bias.unsqueeze(1), weight, cols)).t()
    else:
        out = F.linear(flat, weight, bias)
    return out[:rows].contiguous().view(*x.shape[:-1], weight.shape[0])


class Layout:
    """Per row count: (layout, weight in that layout, MKL-packed copy or None). Layouts:
      "nn"     the stored weight in `stored_product`'s form (the default everywhere);
      "nt"     a row-major copy, F.linear as an NT GEMM (MKL streams it like a GEMV on some CPUs);
      "wx"     a row-major copy, computed as W x^T: the weight is the GEMM's big left operand (one row is
               computed as two: a GEMM where the BLAS's GEMV is slow);
      "packed" an MKL-packed copy for exactly that row count (no re-packing per call).
    Inputs of a row count without a form use `stored_product`. A form that rounds otherwise than the stored
    one on this CPU (checked when built) is dropped for "nn"."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 forms: dict[int, tuple[str, torch.Tensor, torch.Tensor | None]],
                 exact: dict[tuple[int, str], bool]) -> None:
        self.weight, self.bias, self.forms, self.exact = weight, bias, forms, exact

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, plan: dict[int, str] | None,
              copies: bool = True, previous: Layout | None = None) -> Layout | None:
        """The forms of `plan` (rows -> layout; key 0: every other count from 2 to SMALL_ROWS rows) for a
        weight [out, in]; None when nothing differs from the stored form (no plan, not fp32 on the CPU, or
        copies=False on a column-major weight). copies=False
        takes only the layouts that need no copy (a tied LM head: its row-major weight is the embedding
        itself). Copies and checks of `previous` are reused (tuning switches plans often); each copy
        costs one row-major copy, plus one per packed count."""
        if not plan or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        old = previous.forms if previous is not None else {}
        row_major = next((w for kind, w, _ in old.values() if kind != "nn"), None)
        packs = {rows: p for rows, (kind, _, p) in old.items() if kind == "packed"}
        layout_of = cls(weight, bias, {}, dict(previous.exact) if previous is not None else {})
        for rows, layout in sorted(plan.items()):
            if layout not in LAYOUTS:
                raise ValueError(f"Linear.set_layouts: unknown layout {layout!r} for {rows} rows; "
                                 "use nn, nt, wx or packed.")
            if layout == "packed" and (rows < 2 or not torch.backends.mkl.is_available()):
                layout = "nn"
            if layout != "nn" and row_major is None:
                row_major = weight.detach().contiguous()
                if not copies and row_major.data_ptr() != weight.data_ptr():
                    return None
            chosen = weight if layout == "nn" else row_major
            packed = None
            if layout == "packed":
                packed = packs.get(rows)
                packed = torch.ops.mkl._mkl_reorder_linear_weight(chosen, rows) if packed is None else packed
            layout_of.forms[rows] = (layout, chosen, packed)
            if not layout_of.rounds_as_stored(rows):
                layout_of.forms[rows] = ("nn", weight, None)
        return layout_of

    @torch.no_grad()
    def rounds_as_stored(self, key: int) -> bool:
        """Whether the form for `key` gives `stored_product`'s bits (at each of CHECK_ROWS for key 0),
        on a fixed random input; remembered per (key, layout)."""
        kind = self.forms[key][0]
        if kind == "nn":
            return True
        if (key, kind) not in self.exact:
            counts = [key] if key else CHECK_ROWS
            gen = torch.Generator().manual_seed(key)
            probes = [torch.randn(rows, self.weight.shape[1], generator=gen) for rows in counts]
            self.exact[(key, kind)] = all(torch.equal(self(x), stored_product(x, self.weight, self.bias))
                                          for x in probes)
        return self.exact[(key, kind)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        form = self.forms.get(rows, self.forms.get(0) if 1 < rows <= SMALL_ROWS else None)
        if form is None or form[0] == "nn":
            return stored_product(x, self.weight, self.bias)
        kind, weight, packed = form
        flat = x.reshape(rows, -1)
        if kind == "wx":
            # One row goes as two: some BLAS (MKL on AMD) run a 2-column GEMM faster than a GEMV
            # (torch.cat: ~4 us per call against repeat's ~30, times 120 projections per token).
            cols = (flat if rows > 1 else torch.cat((flat, flat))).t()
            out = (torch.mm(weight, cols) if self.bias is None
                   else torch.addmm(self.bias.unsqueeze(1), weight, cols))[:, :rows].t().contiguous()
        elif kind == "packed":
            out = torch.ops.mkl._mkl_linear(flat, packed, weight, self.bias, rows)
        else:
            out = F.linear(flat if rows > 1 else torch.cat((flat, flat)), weight, self.bias)[:rows]
        return out.view(*x.shape[:-1], weight.shape[0])
