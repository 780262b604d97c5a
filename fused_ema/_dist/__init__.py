"""Distributed tensors: DTensor primitives (local shards, placements) that the ops and every layer
above use, and ModelEma(shard=...)'s chunked EMA of a replicated model. Imports only _ext."""
