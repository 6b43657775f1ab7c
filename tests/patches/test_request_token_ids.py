from sglang_ext.patches.shared.request_token_ids import out_of_vocabulary


def test_ids_inside_the_vocabulary_pass():
    assert out_of_vocabulary([0, 5, 9], 10) is None
    assert out_of_vocabulary([], 10) is None and out_of_vocabulary(None, 10) is None


def test_the_first_id_outside_is_named_with_its_position():
    assert out_of_vocabulary([3, 10, -1], 10).startswith("input_ids[1] = 10 is not a token id")
    assert "valid ids are 0..9" in out_of_vocabulary([-1], 10)
