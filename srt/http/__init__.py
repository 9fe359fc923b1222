"""The HTTP process's protective layers: one error envelope, authentication, request limits,
readiness, metrics and request logging. `srt.http.layer.install` puts them on the FastAPI app.

Nothing here imports torch or the model process's modules.
"""
