"""The state-store service: the disk tier (safetensors blobs) and checkpoint metadata."""
