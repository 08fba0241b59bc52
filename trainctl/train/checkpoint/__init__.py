"""Checkpoints: the store on disk (atomic commit, manifest, verify), why a save failed, what a checkpoint holds
(state), and where a run starts (resume)."""
