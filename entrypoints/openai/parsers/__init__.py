"""The built-in tool-call and reasoning parsers (`--tool-call-parser`, `--reasoning-parser`).

They are registered in pyproject.toml under the `tokenmill.tool_parsers` / `tokenmill.reasoning_parsers`
entry-point groups exactly as a plugin's are, and found through `tokenmill.plugins.discovery`.

  base.py                 the incremental machinery: a parser re-reads the whole text so far into a
                          monotone "what is certain" view, the base class sends what grew
  json_scan.py            a tolerant scanner for tool-call JSON objects that may still be incomplete
  tool_parsers.py         hermes, llama3_json, mistral, pythonic (Gemma's ```tool_code fence too)
  family_tool_parsers.py  granite, phi4_mini_json, glm45, cohere_command3
  reasoning_parsers.py    qwen3, deepseek_r1, glm45, granite, cohere_command3
"""
