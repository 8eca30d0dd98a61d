"""Data: conversation readers, chat-template rendering with loss masks, draft vocab, regeneration."""
