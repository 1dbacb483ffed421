"""The Gradio chat, split by concern (`apps/chat.py` is its entry point): `session` (no Gradio),
`render`, `ui`."""
