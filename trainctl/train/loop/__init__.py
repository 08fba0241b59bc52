"""The training loop: trainer (setup, run, train_loop), one step, the loss, micro-batches, guards, stop requests,
the token data the loop reads, and the Job that holds it all."""
