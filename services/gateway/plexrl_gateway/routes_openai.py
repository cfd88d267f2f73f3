"""OpenAI-compatible inference on served base models and sampler checkpoints."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
