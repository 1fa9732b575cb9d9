"""The continuous-batching manager's internals the server reads, in one place.

transformers (5.24) has no public way to forget a cancelled request's result handler (a cancelled request never
delivers a last output), to drain the outputs that land in the manager's shared queue after their request was
cancelled, or to count the scheduler's active and waiting requests. Each is one function here;
``tests/test_serving.py::test_the_managers_internals_the_server_reads_are_there`` fails, naming the attribute, when a
transformers release moves one.
"""

from __future__ import annotations

__all__ = ["drop_result_handler", "drain_unread_results", "request_counts", "failed"]


def drop_result_handler(manager, request_id: str) -> None:
    """Forget ``request_id``'s handler (``register_result_handler``'s inverse, which the manager lacks)."""
    manager.output_router.result_handlers.pop(request_id, None)


def drain_unread_results(manager) -> None:
    """Empty the manager's shared output queue: every output left there belongs to a request already closed."""
    while manager.get_result(timeout=0) is not None:
        pass


def request_counts(manager) -> tuple[int, int]:
    """``(active, waiting)`` requests of the manager's scheduler; ``(0, 0)`` before its loop has started."""
    processor = manager.batch_processor
    scheduler = processor.scheduler if processor is not None else None
    return (len(scheduler.active_requests), len(scheduler.waiting_requests)) if scheduler else (0, 0)


def failed(manager) -> bool:
    """The manager's generation loop stopped on an error."""
    return manager.background_thread_status.fatal_error is not None
