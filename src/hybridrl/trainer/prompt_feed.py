"""The training steps' prompt batches: an endless pass over the data loader, what a step draws, the loader
state a resume starts from and the epoch of each step's prompts."""
from __future__ import annotations


def endless(loader):
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            return


class PromptFeed:
    """The training steps' prompt batches, drawn from an endless pass over the loader, and the loader state a
    resume after a step starts from.

    A step draws its prompts (`step_prompts`), with async_training.staleness_threshold=1 also the next step's
    (`upcoming`, generated while this step trains), and DAPO's dynamic sampling draws more (`more`)."""

    def __init__(self, loader, ahead: bool):
        self.loader, self.ahead = loader, ahead
        self.batches, self.upcoming, self._before_upcoming = endless(loader), None, None
        self.epoch, self._upcoming_epoch = 0, 0
        """The epoch (from 0) of the current step's prompts: verl's training/epoch."""

    def step_prompts(self, prefetch: bool):
        """This step's prompts; with `prefetch`, the next step's are drawn now into `upcoming`."""
        if self.upcoming is not None:
            prompts, self.epoch = self.upcoming, self._upcoming_epoch
        else:
            prompts, self.epoch = next(self.batches), self._drawn_epoch()
        self._before_upcoming = self.loader.state_dict()
        self.upcoming = next(self.batches) if prefetch else None
        self._upcoming_epoch = self._drawn_epoch()
        return prompts

    def _drawn_epoch(self) -> int:
        """The epoch of the batch drawn last (the loader's position already points past it)."""
        return self.loader.epoch - 1 if self.loader.batch_index == 0 else self.loader.epoch

    def more(self):
        """One more prompt batch for the current step."""
        return next(self.batches)

    def resume_state(self) -> dict:
        """Where a resume after the current step starts: after every batch it drew; ahead (staleness 1), at the
        prefetched prompts, whose generation is saved in flight with the checkpoint."""
        return self._before_upcoming if self.ahead else self.loader.state_dict()
