"""An OpenAI-compatible HTTP server over one engine (`python -m paged.serve`, docs/serving.md): the
endpoints and SSE streams vLLM's and SGLang's benchmark clients drive, an engine thread fed through
a queue (`engine_loop`), request bodies checked into `SamplingParams` (`protocol`), response bodies
(`responses`), Prometheus metrics (`prometheus`), and the run around it (`server`)."""
