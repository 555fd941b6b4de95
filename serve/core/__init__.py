"""The processes: the engine core in a process of its own (`process`, `python -m
serve.core.process`), the API-process side of it (`client`, `api_process`), their wire format
(`wire`), tensor-parallel followers (`tp`) and what the flags build in each process (`setup`).

The top room: it may import `serve.http`, `serve.engine` and `serve.kvstore`; none of them imports it.
"""
