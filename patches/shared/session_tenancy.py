"""Sessions belong to a tenant: a turn from another cache namespace than its session's is refused
(HTTP 400 naming the field) before SGLang's session code sees it, so it reads nothing of the
session and gives nothing back to the tree (`sglang_ext.session_tenancy`).

Target (SGLang 0.5.23): `srt/managers/scheduler.py::Scheduler._handle_generate_request`, which
routes a request with `session_params.id` to its session (`Session.create_req`: the turn's prompt
becomes the session's history plus the turn's tokens; a streaming session's slot lends the turn its
KV and linear state). The wrapper binds an open session to its first turn's namespace
(`extra_key`, `cache_salt`, LoRA) and answers a turn of another namespace as SGLang answers a turn
of an unknown session: a request of the turn's own tokens, pre-aborted
(`Req.set_finish_with_abort`, 400 with the reason), queued. Every rank of a replica receives the
same requests and runs this alike. Applies to every backend (SGLang's own cache too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

TARGET = "srt/managers/scheduler.py: Scheduler._handle_generate_request"


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def _handle_generate_request(self, recv_req, *args, **kwargs):
        params = getattr(recv_req, "session_params", None)
        session_id = None if params is None else params.id
        session = None if session_id is None else self.session_controller.get(session_id)
        radix_native = getattr(recv_req, "session_id", None) is not None and self.enable_session_radix_cache
        if session is not None and not radix_native and not session.close_on_finish:
            from sglang_ext.session_tenancy import Tenant, bind, refusal

            turn = Tenant.of(recv_req)
            why = refusal(session_id, bind(session, turn), turn)
            if why is not None:
                req = self._create_generation_req(recv_req, recv_req.rid, recv_req.input_text, recv_req.input_ids,
                                                  recv_req.sampling_params, vocab_size=self.model_config.vocab_size,
                                                  http_worker_ipc=recv_req.http_worker_ipc)
                req.tokenizer = self.tokenizer
                req.set_finish_with_abort(why)
                self.init_req_max_new_tokens(req)
                self._add_request_to_queue(req)
                return None
        return original(self, recv_req, *args, **kwargs)

    return _handle_generate_request


def apply() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    Scheduler._handle_generate_request = _wrap(Scheduler._handle_generate_request)
