# A reward file in verl's own form (verl/utils/reward_score/gsm8k.py's shape: module-level
# compute_score(data_source, solution_str, ground_truth, extra_info=None)), used unchanged.
import re


def extract_solution(solution_str, method="strict"):
    solution = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
    if solution is None:
        return None
    return solution.group(0).split("#### ")[1].replace(",", "").replace("$", "")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, method="strict", format_score=0.0,
                  score=1.0):
    if data_source == "const_quarter":
        return 0.25
    if data_source == "const_three_quarters":
        return {"score": 0.75, "acc": True}
    if data_source == "judge":  # rows with no label: verl passes ground_truth=None
        return 1.0 if ground_truth is None else 0.0
    if data_source == "raises":
        raise RuntimeError("verl scorer failed on purpose")
    answer = extract_solution(solution_str=solution_str, method=method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
