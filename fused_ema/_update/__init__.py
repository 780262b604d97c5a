"""One ModelEma update and when it runs: the decay schedule, the plan every mode runs, the binding
to the model followed, the update transaction, non_blocking, torch.compile and attach()."""
