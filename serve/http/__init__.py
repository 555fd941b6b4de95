"""The HTTP side: the Starlette app (`app`), the three APIs (`openai_api`: chat completions and
completions; `responses_api`; `anthropic_api`), what they share (`chat`: prompt, engine requests,
output parsing, tool choice; `protocol`: field checks; `request_policy`: unknown fields, refused
fields, bounds), exact replay (`replay`), the browser guard (`guard`) and what a request reused of
the cache, shown (`cache_explain`).

Imports `serve.engine` (the request types and the in-process engine) and `serve.kvstore`; never
`serve.core`.
"""
