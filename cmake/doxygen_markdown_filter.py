"""Doxygen's input filter for the Markdown pages: GitHub names a heading's anchor after its text
(lowercase, punctuation dropped, spaces as hyphens), so README's table of contents links
#the-policies; Doxygen 1.9 gives headings no such name. This adds it as Doxygen's own label,
`## The policies {#the-policies}`, outside code blocks, so the same file reads right in both."""
import re
import sys

fence = False
with open(sys.argv[1], encoding="utf-8") as f:
    for line in f:
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^(#{2,4}) (.+?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(2).lower()).replace(" ", "-")
            line = f"{m.group(1)} {m.group(2)} {{#{slug}}}\n"
        sys.stdout.write(line)
