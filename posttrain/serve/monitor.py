"""The admin page's numbers: progress, per-annotator counts, agreement and position/length bias.

Everything is computed from each annotator's latest vote per pair (as the export counts them). Agreement:
Cohen's κ for every two annotators who share at least one pair, and Krippendorff's α (nominal) over the
pairs with votes from two or more annotators. Bias: over the decisive latest votes (a response won), the
share that went to the response shown on the left, and, where the two responses differ in length, the
share that went to the longer one, each with an exact two-sided binomial test against 1/2 (see
``posttrain.serve.agreement`` for the formulas).
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations
from typing import Any

from posttrain.serve.agreement import cohen_kappa, krippendorff_alpha_nominal, share_test
from posttrain.serve.db import FeedbackDB
from posttrain.serve.export import latest_votes, vote_label


def admin_stats(db: FeedbackDB, recent: int = 20) -> dict[str, Any]:
    log = db.vote_log()
    by_pair = latest_votes(log)
    pairs = int(db.scalar("SELECT COUNT(*) AS n FROM responses WHERE position >= 1") or 0)
    users = {row["id"]: row for row in db.query("SELECT id, name, role FROM users ORDER BY id")}
    lengths = {row["id"]: row["n"] for row in db.query("SELECT id, LENGTH(text) AS n FROM responses")}

    per_annotator: Counter = Counter(v["annotator_id"] for v in log)
    labels: dict[int, dict[tuple[str, str], str]] = {}
    for pair, votes in by_pair.items():
        for vote in votes:
            labels.setdefault(vote["annotator_id"], {})[pair] = vote_label(vote)
    kappas = []
    for first, second in combinations(sorted(labels), 2):
        shared = sorted(set(labels[first]) & set(labels[second]))
        if shared:
            kappa = cohen_kappa([labels[first][p] for p in shared], [labels[second][p] for p in shared])
            kappas.append({"annotators": [users[first]["name"], users[second]["name"]], "shared": len(shared),
                           "kappa": kappa})
    multi = [[vote_label(v) for v in votes] for votes in by_pair.values() if len(votes) >= 2]

    decisive = [v for votes in by_pair.values() for v in votes if vote_label(v) in ("a", "b")]
    left_wins = sum(v["winner"] == v["shown_left_id"] for v in decisive)
    unequal = [v for v in decisive if lengths[v["response_a_id"]] != lengths[v["response_b_id"]]]
    longer_wins = sum(lengths[v["winner"]] == max(lengths[v["response_a_id"]], lengths[v["response_b_id"]])
                      for v in unequal)  # fmt: skip
    recent_votes = db.query(
        """SELECT v.id, v.created_at, u.name AS annotator, v.winner, v.response_a_id, v.response_b_id, v.reason,
                  e.prompt AS prompt FROM votes v JOIN users u ON u.id = v.annotator_id
             JOIN edge_cases e ON e.id = v.edge_case_id ORDER BY v.id DESC LIMIT ?""",
        (recent,),
    )
    for vote in recent_votes:
        vote["choice"] = vote_label(vote)
    return {
        "progress": {
            "edge_cases": int(db.scalar("SELECT COUNT(*) AS n FROM edge_cases") or 0),
            "pairs": pairs,
            "pairs_with_1_vote": sum(1 for votes in by_pair.values() if len(votes) >= 1),
            "pairs_with_2_votes": len(multi),
            "votes": len(log),
        },
        "annotators": [{"name": users[uid]["name"], "votes": per_annotator[uid], "pairs": len(labels.get(uid, {}))}
                       for uid in sorted(per_annotator)],
        "agreement": {"cohen_kappa": kappas, "krippendorff_alpha": krippendorff_alpha_nominal(multi),
                      "pairs_with_2_votes": len(multi)},
        "position_bias": share_test(left_wins, len(decisive)),
        "length_bias": share_test(longer_wins, len(unequal)),
        "recent_votes": recent_votes,
    }  # fmt: skip
