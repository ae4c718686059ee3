"""Model and table files: safetensors I/O and dtype widening, atomic writes, fetching, provenance, tables,
job logs."""
