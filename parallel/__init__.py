"""Beyond one GPU: the pack's torch.distributed world (rank 0 = the ComfyUI process, one worker per extra device)."""
