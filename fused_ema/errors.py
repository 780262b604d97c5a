"""Errors and warnings of fused_ema's public API."""

from __future__ import annotations


class StructureMismatchError(RuntimeError):
    """The model's named tensors no longer match the EMA's: some were added, removed, renamed,
    reshaped or replaced by new tensor objects. Lists every name; nothing was changed."""

    def __init__(self, added=(), removed=(), reshaped=(), replaced=(), hint: str = "", renamed=()):
        self.added, self.removed = list(added), list(removed)
        self.reshaped, self.replaced = list(reshaped), list(replaced)
        self.renamed, self.hint = list(renamed), hint
        lines = ["the model's tensors no longer match this EMA's (nothing was changed):"]
        for label, items in (
            ("added", self.added),
            ("removed", self.removed),
            ("renamed (the same tensor under a new name)", self.renamed),
            ("reshaped", self.reshaped),
            ("replaced by a new tensor", self.replaced),
        ):
            if items:
                lines.append(f"  {label} ({len(items)}): {', '.join(map(str, items))}")
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.reshaped or self.replaced or self.renamed)

    def __reduce__(self):
        # Exception's own rebuilds from args (the message), which read as a list of added names:
        # pickling (multiprocessing, a spawned rank) and deepcopy rebuild from the lists instead.
        lists = (self.added, self.removed, self.reshaped, self.replaced)
        return type(self), (*lists, self.hint, self.renamed), self.__dict__


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded into this EMA. Lists every problem; the EMA is unchanged."""

    def __init__(self, problems: list[str], source: str = "checkpoint"):
        self.problems, self.source = list(problems), source
        listing = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"cannot load {source} into this EMA ({len(self.problems)} problem"
            f"{'s' if len(self.problems) != 1 else ''}; the EMA was not changed):\n{listing}"
        )

    def __reduce__(self):
        # As StructureMismatchError's: rebuilt from the problems, not from the message.
        return type(self), (self.problems, self.source), self.__dict__


class PrecisionWarning(UserWarning):
    """An EMA dtype too coarse for its decay: most updates would round away."""
