"""The one wording of a size in bytes, for every message and report tfmem prints."""


def format_bytes(num_bytes: float) -> str:
    """`1536 * 2**20` → "1.50 GiB"; below 1 GiB in MiB."""
    if abs(num_bytes) >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"
