"""State capture: what a training state is made of and how it becomes JSON + tensors."""
