"""How an EMA sees a model: which tensors it has and under which names (walk, name filters), the
EMA's entries matched to them (tracking), the evaluation module and swapping weights in and out."""
