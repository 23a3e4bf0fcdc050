"""``polarstream ui``: a read-only web view of what a run recorded, straight from its topics.

    index.py    records of one topic prefix -> an in-memory index (sessions, groups, rewards)
    lanes.py    a session's calls -> chains drawn as lanes, and a chain's tokens -> spans
    reader.py   a thread per prefix: reads the topics to their end, then follows them
    pages.py    HTML of the runs, group, session and trace pages (pure functions of the index)
    app.py      the Starlette app: routes, the admin token off loopback, static files
    cli.py      the ``ui`` command

No database: the index lives in memory and is rebuilt from the topics on every start.
"""
