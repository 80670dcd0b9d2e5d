"""What both backends' train steps say about cutting a batch into micro-batches by rows.

The names of a batch's tensors (`x['ids']`, `y`, `sample_weight`) and the errors for a tensor that
cannot be cut by rows live here, so that TensorFlow and JAX word them alike.
"""

from __future__ import annotations

import keras


def named_tensors(batch: tuple) -> list[tuple[str, object]]:
    """`(name, tensor)` for each tensor of `(x, y, sample_weight)`: "x", "x['ids']", "y[1]"."""
    named = []
    for path, tensor in keras.tree.flatten_with_path(batch):
        if tensor is not None:
            name = ("x", "y", "sample_weight")[path[0]]
            named.append((name + "".join(f"[{key!r}]" for key in path[1:]), tensor))
    return named


def scalar_error(name: str, num_steps: int) -> ValueError:
    return ValueError(
        f"AccumModel splits every tensor of a batch into {num_steps} micro-batches by rows (its "
        f"first axis), but `{name}` is a scalar with no rows to split. Give it one row per "
        "sample, or make it a constant of the model."
    )


def rows_mismatch_message(difference: str, name: str, num_steps: int) -> str:
    """`difference` says which tensors differ, e.g. "`x['mask']` has 1 rows and `y` has 16"."""
    return (
        f"AccumModel splits every input, target and sample weight of a batch by rows into "
        f"{num_steps} micro-batches, so all need the same number of rows, but {difference}. "
        f"Give `{name}` one row per sample."
    )
