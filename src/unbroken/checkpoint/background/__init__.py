"""Writing a checkpoint off the training thread (``async_save``): ``thread`` (the one save in flight, its
errors raised in the loop), ``lazy`` (the optimizer's tensors copied only when the next step would change
them), ``shm`` (staging arenas in shared memory) and ``filewriter`` (the writer process that writes them:
``python -m unbroken.checkpoint.background.filewriter``, no torch)."""
