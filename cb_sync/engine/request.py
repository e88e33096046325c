"""Requests' old path: they live in `cb_sync.scheduler.request`."""

from ..scheduler.request import GenerationResult, Request, Status

__all__ = ["GenerationResult", "Request", "Status"]
