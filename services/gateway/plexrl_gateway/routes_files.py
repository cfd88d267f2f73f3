"""Exported weights out: signed, expiring URLs for an export's files, and the files."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
